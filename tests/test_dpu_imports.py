"""The frontend must import and serve without torch, triton or cupy (a DPU image has none)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent('''
    import importlib, pkgutil, sys

    class Blocker:
        """Meta-path finder that makes torch, triton and cupy unimportable."""
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "triton", "cupy"):
                raise ImportError(f"{name} is blocked: the frontend must not need it")
            return None

    sys.meta_path.insert(0, Blocker())
    for name in ("torch", "triton", "cupy"):
        sys.modules.pop(name, None)

    import blink.dpu
    modules = sorted(m.name for m in pkgutil.iter_modules(blink.dpu.__path__, "blink.dpu."))
    for name in modules:
        importlib.import_module(name)

    # ... and serve a request end to end.
    import asyncio, httpx
    from tokenizers import Tokenizer as HF, models, pre_tokenizers, decoders, trainers
    from blink.dpu.app import create_app
    sys.path.insert(0, TESTS)
    from fake_engine_client import FakeEngineClient  # the test double lives in tests/
    from blink.dpu.tokenizer import Tokenizer

    hf = HF(models.BPE()); hf.pre_tokenizer = pre_tokenizers.ByteLevel(); hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["hello world"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer(hf.to_str(), {"eos_token": "</s>"}, {})
    app = create_app(FakeEngineClient(model_name="m"), tok)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert (await c.get("/metrics")).status_code == 200

    asyncio.run(go())
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "cupy"))
    assert not heavy, heavy
    print("OK", len(modules))
''')


def test_dpu_imports_and_serves_without_torch() -> None:
    script = f"TESTS = {str(Path(__file__).parent)!r}\n" + _SCRIPT
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    count = int(result.stdout.split()[-1])
    assert count >= 10  # every dpu module was imported (app, serving, tokenizer, ...)
