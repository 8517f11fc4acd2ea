"""``cache_salt`` in the scheduler's prefix cache (issue 33): requests of the same prompt share
KV blocks only under the same salt; a salted request never hits another salt's blocks nor the
unsalted ones, and the unsalted never hit salted ones. Through the CPU loop's stages (C where
they are), and the fused Triton stages (``kernels/triton/sched.py``, under the interpreter), with real and with
forced-colliding keys (then verification alone keeps the salts apart)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the fused kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
import test_scheduler as ts  # noqa: E402

from blink.engine import prefix_cache  # noqa: E402
from blink.kernels.cpu import sched as c_sched  # noqa: E402
from blink.shared.sampling_fields import cache_salt_hash  # noqa: E402

PROMPT = list(range(1, 18))  # 4 full blocks of 4 can hit (the last token is recomputed)


def _run(fused: bool) -> dict[str, int]:
    """Request "a0" (salt a) runs first; then a1 (salt a) with b (salt b); then u0
    (unsalted); then u1 (unsalted) with c (salt c). Returns each one's cached tokens. (Waves
    that compute blocks of their own run apart: two new keys competing for one table slot in
    the same step leave the younger block uncached, which is not what is tested here.)"""
    ring = ts.make_ring(4, 32, 8)
    sched = ts.Scheduler(ts._cfg(max_admit_per_step=4), ts.ring_tensors(ring), fused=fused)
    model, fe = ts.FakeModel(sched.config, 4), ts.Frontend(ring)
    salts = {"a0": "a", "a1": "a", "b": "b", "u0": None, "u1": None, "c": "c"}
    waves = {0: ["a0"], 8: ["a1", "b"], 16: ["u0"], 24: ["u1", "c"]}
    reqs = {name: ts.Req(prompt=PROMPT, max_tokens=3, ignore_eos=True) for name in salts}
    cached: dict[str, int] = {}
    pending: list[str] = []
    for step in range(60):
        for name in waves.get(step, []):
            slot = fe.free[0]  # the slot submit() takes
            ring.cache_salt[slot] = cache_salt_hash(salts[name])
            assert fe.submit(reqs[name])
            pending.append(name)
        batch = sched.schedule()
        for name in list(pending):
            slot = reqs[name].slot
            if ring.state[slot] != ts.SLOT_WRITTEN:  # admitted: looked up in this schedule
                cached[name] = int(ring.num_cached_tokens[slot])
                pending.remove(name)
        sched.update(batch, *model(sched, batch))
        fe.poll()
    for r in reqs.values():
        assert (r.out, r.finish) == ts.reference(r, 32)  # the salt changes no token
    return cached


@pytest.mark.parametrize("collide", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_salts_share_blocks_only_within_a_salt(fused, collide, monkeypatch):
    if fused and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused stages were imported without TRITON_INTERPRET=1")
    if collide:  # every key collides: only verification (tokens, parents) and the salt decide
        monkeypatch.setattr(prefix_cache, "table_key", lambda h: torch.zeros_like(h[0]))
        monkeypatch.setattr(c_sched, "COLLIDE_KEYS", True)  # the CPU loop's C stages collide too
        if fused:
            from blink.kernels.triton import sched as triton_sched

            monkeypatch.setattr(triton_sched, "COLLIDE_KEYS", True)
    cached = _run(fused)
    # same salt: a0's 4 full blocks (with every key equal, a salt's blocks share one key, of
    # which the table keeps one entry: only the first block is cached then)
    shared = 4 if collide else 16
    assert cached["a0"] == 0
    assert cached["a1"] == shared
    assert cached["b"] == 0 and cached["u0"] == 0  # another salt, unsalted: none of them
    assert cached["u1"] == shared  # u0's blocks (unsalted)
    assert cached["c"] == 0
