"""Every ring payload the engine writes is fenced off from the word that publishes it.

A CPU reading the GPU-mapped ring over PCIe can see two consecutive kernels' stores out of
order, so the scheduler must put a system-scope fence between the output-stream payload and
``produced``, and between a slot's finish reason / stream reset and its state word. This test
records, in order, every write the engine step makes into the ring (by field) and every
fence, over a workload with finishes, aborts and preemption, and checks that between any
payload write and the next write of its publishing word there is a fence. It runs the CPU
loop; the GPU tiers capture the same scheduler code.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_engine import BASE, random_prompts, tiny_model_dir  # noqa: E402

from blink.engine.sched import scheduler as scheduler_module  # noqa: E402
from blink.engine.engine import Engine  # noqa: E402
from blink.kernels.cpu import sched as c_sched  # noqa: E402
from blink.llm import LLM  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402

#: publishing word -> the payload fields it publishes
PUBLISHES = {
    "produced": {"tokens", "logprob", "top_ids", "top_logprobs"},
    "state": {"finish_reason", "stream_seq", "produced", "num_prompt_tokens", "num_cached_tokens"},
}


class RingWrites(TorchDispatchMode):
    """Logs the ring field each in-place op writes (``events``), given the field ranges."""

    def __init__(self, events: list[str], fields: dict[str, tuple[int, int]], words: tuple[int, int]) -> None:
        super().__init__()
        self.events, self.fields, self.words = events, fields, words

    def _field(self, t: torch.Tensor) -> str | None:
        start, size = t.data_ptr(), t.numel() * t.element_size()
        if (start, size) == self.words:
            return "state"  # the scheduler writes state words through one int32 view of the region
        for name, (lo, hi) in self.fields.items():
            if lo <= start < hi:
                return name
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "blink":  # the fence op itself (it declares the region written)
            return func(*args, **kwargs)
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                t = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(t, torch.Tensor):
                    name = self._field(t)
                    if name is not None:
                        self.events.append(name)
        return func(*args, **kwargs)


def _check(events: list[str]) -> None:
    for word, payload in PUBLISHES.items():
        last_payload, fenced = None, True
        for i, e in enumerate(events):
            if e in payload:
                last_payload, fenced = i, False
            elif e == "FENCE":
                fenced = True
            if e == word:
                assert fenced, (f"write {i} of {word!r} follows the payload write {last_payload} "
                                f"({events[last_payload]!r}) with no fence in between: "
                                f"{events[max(0, (last_payload or 0) - 3): i + 1]}")


@pytest.mark.parametrize("drop_fence", [False, True])
def test_payloads_are_fenced_before_their_publishing_word(tmp_path, monkeypatch, drop_fence):
    # The torch stages, whose writes this recorder sees: the CPU loop's C stages
    # (kernels/cpu/sched.c) write the same fields in one call, with their fences inside it.
    monkeypatch.setattr(c_sched.LIBRARY, "get", lambda: None)
    events: list[str] = []
    real = scheduler_module.system_fence_for

    def recording_fence_for(device, ordered):
        fence = real(device, ordered)

        def record():
            fence()
            events.append("FENCE")

        return (lambda: None) if drop_fence else record

    monkeypatch.setattr(scheduler_module, "system_fence_for", recording_fence_for)
    orig_step = Engine.step

    def audited_step(self):
        ring = self.scheduler.ring
        fields = {name: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                  for name, t in ring.items() if name not in ("region", "control")}
        words = self.scheduler._words
        with RingWrites(events, fields, (words.data_ptr(), words.numel() * words.element_size())):
            return orig_step(self)

    monkeypatch.setattr(Engine, "step", audited_step)
    model = tiny_model_dir(tmp_path)
    prompts = random_prompts(6, 20, 60, seed=4)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2)
              for m in (3, 9, 5, 12, 1, 7)]
    with LLM(str(model), **dict(BASE, kv_cache_tokens=512, max_num_batched_tokens=64)) as llm:
        llm.generate(prompts, params, timeout_s=120)
    for field in ("tokens", "produced", "finish_reason", "state"):
        assert field in events, f"the recorder saw no write of {field}"
    if drop_fence:
        with pytest.raises(AssertionError, match="no fence"):
            _check(events)
    else:
        assert "FENCE" in events
        _check(events)


_FENCE_PTX = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blink.kernels.triton.fence import fence_kernel
src = ASTSource(fence_kernel, {"word_ptr": "*i32"}, {}, {})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"])
"""


def test_the_cuda_fence_kernel_compiles_to_a_system_scope_fence():
    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no CUDA backend")
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _FENCE_PTX], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    body = proc.stdout[proc.stdout.index(".entry fence_kernel"):]
    fence, store = body.index("fence.sc.sys;"), body.index("st.global")
    assert fence < store  # the fence is issued, and before the kernel's only store
