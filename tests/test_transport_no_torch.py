"""The transport and the frontend's ring client import on a DPU image: no torch/triton/cupy."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "triton", "cupy"):
                raise ImportError(f"{name} is blocked (DPU image)")

    sys.meta_path.insert(0, Block())
    import blink.transport, blink.transport.loopback, blink.transport.bootstrap
    import blink.transport.verbs
    import blink.dpu.ring_protocol, blink.dpu.ring_packing, blink.dpu.engine_health
    import blink.dpu.ring_engine_client
    import blink.transport.auth, blink.frontend_main, blink.launcher  # the frontend process
    from blink.transport import LoopbackRegion
    with LoopbackRegion(4096):
        pass
    bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "cupy"))
    assert not bad, bad
    print("ok")
""")


def test_imports_without_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
