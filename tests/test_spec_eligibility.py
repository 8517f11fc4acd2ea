"""Speculative decoding's draft eligibility, kept in two places (issue 36): the tensor rule
in :meth:`SpecScheduler._draft` (GPU loops, graphs) and the CPU loop's host-side reading of
it (:meth:`SpecScheduler._eligible_host`, plain reads of the same memory). Both are driven on
the same scheduler states, step after step (the back-off counts down), and must leave the
same drafts, draft lengths, token counts and back-off state: random states and the edge
cases (prefilling and finished rows, masked rows, prefix lookups pending, rows at
max_model_len / max_tokens / a nearly full output stream, back-off, history with and without
a repeat of the last token), with the n-gram drafter and with one that drafts everywhere
(a draft model)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
import test_scheduler as ts  # noqa: E402

from blink.engine.sched.state import ROW_EMPTY, ROW_RELEASING, ROW_RUNNING, ROW_WAITING, ring_tensors  # noqa: E402
from blink.engine.speculative import NgramDrafter, SpecScheduler  # noqa: E402
from blink.shared.speculative_config import SpeculativeConfig  # noqa: E402

S, L, CAPACITY, K = 12, 24, 6, 3


class EverywhereDrafter(NgramDrafter):
    """A drafter like a draft model: drafts for every row asked (``repeats_only`` False)."""

    repeats_only = False

    @staticmethod
    def propose(tokens, lengths, k, lookup_min, lookup_max, row_min_n):
        last = tokens.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1))
        draft = (last + 1 + torch.arange(k)) % 7
        return draft, torch.where(lengths > 0, k, 0)


def _sched(drafter, host: bool) -> tuple[SpecScheduler, dict]:
    cfg = ts._cfg(max_model_len=L, num_blocks=4 * S * L // 4, max_num_batched_tokens=64)
    ring = ts.make_ring(S, L, CAPACITY)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_min=1,
                             prompt_lookup_max=3)
    sched = SpecScheduler(cfg, ring_tensors(ring), spec=spec, host_guards=True, drafter=drafter)
    assert sched._host_views is not None  # the CPU loop's host path exists
    if not host:
        sched._host_views = None  # the tensor rule
    sched._w = sched._window(S)
    return sched, ring_tensors(ring)


def _random_state(rng: np.random.Generator, edge: bool) -> dict[str, np.ndarray]:
    """Per row: status, prompt, tokens, computed, lookup, constrained, max_tokens, stream
    fill, back-off. Running rows are as the scheduler leaves them (at least one token
    computed, below max_model_len and max_tokens); the others anything."""
    status = rng.choice([ROW_EMPTY, ROW_WAITING, ROW_RUNNING, ROW_RELEASING], S, p=[.1, .15, .6, .15])
    n = rng.integers(2, L, S)  # a running row at L has finished
    p = np.array([rng.integers(1, m + 1) for m in n])
    computed = np.where(rng.random(S) < 0.7, n - 1, [rng.integers(0, m + 1) for m in n])
    computed = np.where(status == ROW_RUNNING, np.maximum(computed, 1), computed)
    vocab = 4 if not edge else 50  # small: repeats everywhere; large: few
    tokens = rng.integers(0, vocab, (S, L))
    if edge:  # a last token that never occurred before in some rows, repeated in others
        for r in range(S):
            if rng.random() < 0.5:
                tokens[r, n[r] - 1] = 100 + r
    out = n - p
    max_tokens = np.where(rng.random(S) < 0.4, 0, out + 1 + rng.integers(0, 3 if edge else 8, S))
    fill = rng.integers(0, CAPACITY + 1, S)  # produced - consumed
    streak = rng.integers(0, 4, S) * (rng.random(S) < 0.5)
    cooldown = rng.integers(0, 4, S) * (rng.random(S) < 0.5)
    if edge:
        n = np.where(rng.random(S) < 0.3, L - 1, n)  # one token of room left before max_model_len
        computed = np.where(status == ROW_RUNNING, np.minimum(computed, n), computed)
        p = np.minimum(p, n)
        max_tokens = np.where(max_tokens > 0, np.maximum(max_tokens, n - p + 1), 0)
    return dict(status=status, n=n, p=p, computed=computed, tokens=tokens,
                lookup=rng.random(S) < 0.1, constrained=(rng.random(S) < 0.15).astype(np.int32),
                max_tokens=max_tokens, fill=fill, streak=streak, cooldown=cooldown)


def _load(sched: SpecScheduler, ring: dict, s: dict[str, np.ndarray]) -> None:
    st = sched.state
    st.status.copy_(torch.from_numpy(s["status"]).to(st.status.dtype))
    st.num_tokens.copy_(torch.from_numpy(s["n"]))
    st.num_prompt.copy_(torch.from_numpy(s["p"]))
    st.num_computed.copy_(torch.from_numpy(s["computed"]))
    st.tokens[:, :L] = torch.from_numpy(s["tokens"]).to(st.tokens.dtype)
    st.needs_lookup.copy_(torch.from_numpy(s["lookup"]))
    st.sampling["constrained"].copy_(torch.from_numpy(s["constrained"]).to(st.sampling["constrained"].dtype))
    st.sampling["max_tokens"].copy_(torch.from_numpy(s["max_tokens"]).to(st.sampling["max_tokens"].dtype))
    ring["consumed"].zero_()
    ring["produced"].copy_(torch.from_numpy(s["fill"]).to(ring["produced"].dtype))
    sched.miss_streak.copy_(torch.from_numpy(s["streak"]))
    sched.cooldown.copy_(torch.from_numpy(s["cooldown"]))


def _snapshot(sched: SpecScheduler) -> dict[str, list]:
    st = sched.state
    d = sched.draft_len[:S].tolist()
    return dict(draft_len=d, num_tokens=st.num_tokens.tolist(), miss_streak=sched.miss_streak.tolist(),
                cooldown=sched.cooldown.tolist(),  # not ``drafted``: the tensor rule has no host read
                drafts=[st.tokens[r, :st.num_tokens[r]].tolist() for r in range(S)])


@pytest.mark.parametrize("drafter", [NgramDrafter, EverywhereDrafter])
@pytest.mark.parametrize("edge", [False, True])
def test_host_and_tensor_eligibility_agree(drafter, edge):
    rng = np.random.default_rng(7 + edge)
    pair = [_sched(drafter(), host=True), _sched(drafter(), host=False)]
    drafted = 0
    for case in range(60):
        state = _random_state(rng, edge)
        for sched, ring in pair:
            _load(sched, ring, state)
        for step in range(4):  # the back-off counts down step by step
            snaps = []
            for sched, _ in pair:
                sched._draft()
                snaps.append(_snapshot(sched))
                sched.state.num_tokens -= sched.draft_len  # as _build_batch takes them back
            host, tensor = snaps
            assert host == tensor, f"case {case} step {step}: host {host} != tensor {tensor}"
            drafted += sum(host["draft_len"])
    assert drafted > 0  # the states do reach drafting rows
