"""Engine-level tests, through ``LLM.generate`` (the ring, the loopback transport and the
``blink-loop`` engine thread), on a tiny random Llama with a byte-level tokenizer.

Greedy outputs are checked against transformers' own greedy continuation of the same model
(``generate`` with an explicit attention mask), so a test fails when the engine is wrong even
if it is consistently wrong: with and without preemption, with and without the prefix cache,
one request vs many, chunked vs unchunked prefill. The rest: seeded sampling independent of
the batch, cancellation within one step (slot and KV blocks back), full output streams with
a slow reader, the loop thread's name and idle CPU use, a failing model, max_model_len.

The helpers here (tiny model directory with a tokenizer, transformers reference) are shared
with tests/test_llm.py.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from helpers_models import VOCAB, build_hf_model, make_tiny_model  # noqa: E402

from blink.dpu.ring_packing import ring_fields  # noqa: E402
from blink.llm import LLM  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402
from blink.errors import BlinkError  # noqa: E402
from blink.ring import (  # noqa: E402
    C_STAT_KV_BLOCKS_USED,
    C_STAT_PREEMPTIONS,
    C_STAT_PREFIX_HITS,
    C_STAT_RUNNING,
    C_STAT_STEPS,
    C_STAT_WAITING,
    ENGINE_FAILED,
    SLOT_FREE,
)
from blink.threads.roles import task_ids, task_name  # noqa: E402

ARCH = "llama"
GREEDY = dict(temperature=0.0, ignore_eos=True)
#: sizes of the default test engine (kv_cache_tokens is explicit: the default 1 GiB would
#: give the tiny model ~130k blocks, which only slows every scheduler step down). dtype is
#: pinned to float32: greedy outputs are compared token for token with transformers' fp32
#: (``auto`` would pick bf16 on a CPU with native bf16 for a non-fp32 checkpoint).
BASE = dict(max_model_len=256, max_num_seqs=16, kv_cache_tokens=4096, max_num_batched_tokens=512,
            dtype="float32")


# ------------------------------------------------------------------------ shared helpers


def byte_tokenizer_json() -> str:
    """A byte-level BPE with no merges: token id == byte value (VOCAB == 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from blink.shared.byte_level import unicode_to_bytes

    assert VOCAB == 256
    vocab = dict(unicode_to_bytes())  # printable char -> byte
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def tiny_model_dir(root: Path, eos_token_id: int | None = None, name: str | None = None) -> Path:
    """The tiny ``ARCH`` model (weights from helpers_models) plus a byte tokenizer, optionally
    with an EOS token declared in config.json and generation_config.json."""
    base = make_tiny_model(ARCH, Path(root) / "_weights")
    path = Path(root) / (name or (ARCH if eos_token_id is None else f"{ARCH}-eos{eos_token_id}"))
    if not (path / "tokenizer.json").exists():
        shutil.copytree(base, path, dirs_exist_ok=True)
        (path / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
        if eos_token_id is not None:
            for file in ("config.json", "generation_config.json"):
                cfg = json.loads((path / file).read_text()) if (path / file).exists() else {}
                cfg["eos_token_id"] = eos_token_id
                (path / file).write_text(json.dumps(cfg))
    return path


class Reference:
    """transformers' model with the same weights: greedy continuations and raw logits."""

    def __init__(self) -> None:
        self.model = build_hf_model(ARCH)

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0, **kwargs,
        )
        return out[0, len(prompt):].tolist()

    @torch.inference_mode()
    def logits(self, seq: list[int]) -> torch.Tensor:
        """fp32 logits [len(seq), V] of one forward over ``seq``."""
        return self.model(torch.tensor([seq])).logits[0].float()


def assert_greedy(ref: Reference, prompt: list[int], got: list[int], want: list[int]) -> None:
    """``got`` must equal transformers' greedy ``want``. A divergence is accepted only at a
    numerical near-tie (the two tokens' reference logits within 1e-4), after which ``got``
    must still be greedy under teacher forcing."""
    if got == want:
        return
    assert len(got) == len(want), f"length {len(got)} != reference {len(want)}"
    i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = ref.logits(prompt + got)[len(prompt) - 1:]
    gap = float(logits[i, want[i]] - logits[i, got[i]])
    assert abs(gap) < 1e-4, (
        f"token {i}: engine chose {got[i]}, greedy is {want[i]} (logit gap {gap:.3g})\n"
        f"engine:    {got}\nreference: {want}"
    )
    chosen = logits[torch.arange(len(got)), torch.tensor(got)]
    assert bool((chosen >= logits[: len(got)].max(-1).values - 1e-4).all()), "not greedy after a tie"


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def stats(llm: LLM, word: int) -> int:
    """A control-block word, read through the ring client (like the frontend does)."""
    return int(llm._ring.engine_status().control[word])


def wait_for(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def make_llm(path: Path, **overrides) -> LLM:
    return LLM(str(path), **{**BASE, **overrides})


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("engine_models"))


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference()


@pytest.fixture(scope="module")
def llm(model_dir):
    with make_llm(model_dir) as engine:
        yield engine


@pytest.fixture(scope="module")
def tiny_kv_llm(model_dir):
    """KV pool of 9 blocks (144 tokens) for max_model_len 128: preemption is certain."""
    with make_llm(model_dir, max_model_len=128, kv_cache_tokens=144) as engine:
        yield engine


# --------------------------------------------------------------------------- greedy parity

PROMPTS = random_prompts(10, 3, 60, seed=1)
MAX_NEW = 24


@pytest.fixture(scope="module")
def greedy_ref(ref) -> list[list[int]]:
    return [ref.greedy(p, MAX_NEW) for p in PROMPTS]


def test_greedy_batch_matches_transformers(llm, ref, greedy_ref):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, **GREEDY), timeout_s=60)
    for p, o, want in zip(PROMPTS, outs, greedy_ref):
        assert o.prompt_token_ids == p
        assert o.finish_reason == "length"
        assert_greedy(ref, p, o.token_ids, want)


def test_greedy_batch_of_one_equals_batch(llm, ref, greedy_ref):
    for i in (0, 3, 7):
        [o] = llm.generate([PROMPTS[i]], SamplingParams(max_tokens=MAX_NEW, **GREEDY), timeout_s=30)
        assert_greedy(ref, PROMPTS[i], o.token_ids, greedy_ref[i])


def test_greedy_with_preemption(tiny_kv_llm, ref):
    llm = tiny_kv_llm
    prompts = random_prompts(12, 20, 40, seed=2)
    before = stats(llm, C_STAT_PREEMPTIONS)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY), timeout_s=120)
    assert stats(llm, C_STAT_PREEMPTIONS) > before, "the tiny KV pool never preempted"
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length"
        assert_greedy(ref, p, o.token_ids, ref.greedy(p, 40))
    # every block is back (cached-but-free blocks count as free)
    wait_for(lambda: stats(llm, C_STAT_KV_BLOCKS_USED) == 0, what="KV blocks to be freed")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_with_and_without_prefix_cache(model_dir, llm, ref, prefix_caching):
    rng = random.Random(3)
    shared = [rng.randrange(VOCAB) for _ in range(70)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    engine = llm if prefix_caching else make_llm(model_dir, enable_prefix_caching=False)
    try:
        params = SamplingParams(max_tokens=12, **GREEDY)
        hits0 = stats(engine, C_STAT_PREFIX_HITS)
        [warm] = engine.generate([prompts[0]], params, timeout_s=30)  # registers the blocks
        outs = engine.generate(prompts[1:], params, timeout_s=60)
        hits = stats(engine, C_STAT_PREFIX_HITS) - hits0
        for p, o in zip(prompts, [warm, *outs]):
            assert_greedy(ref, p, o.token_ids, ref.greedy(p, 12))
        if prefix_caching:
            assert hits > 0
            assert all(o.num_cached_tokens >= 64 for o in outs), [o.num_cached_tokens for o in outs]
            assert all(o.num_cached_tokens % 16 == 0 and o.num_cached_tokens < len(p)
                       for p, o in zip(prompts[1:], outs))
        else:
            assert hits == 0
            assert all(o.num_cached_tokens == 0 for o in outs)
    finally:
        if engine is not llm:
            engine.close()


def test_greedy_with_preemption_without_prefix_cache(model_dir, ref):
    with make_llm(model_dir, max_model_len=128, kv_cache_tokens=144,
                  enable_prefix_caching=False) as llm:
        prompts = random_prompts(8, 30, 50, seed=4)
        outs = llm.generate(prompts, SamplingParams(max_tokens=30, **GREEDY), timeout_s=120)
        assert stats(llm, C_STAT_PREEMPTIONS) > 0
        for p, o in zip(prompts, outs):
            assert_greedy(ref, p, o.token_ids, ref.greedy(p, 30))


def test_chunked_prefill(model_dir, ref):
    """A 16-token budget: every prompt (40..100 tokens) is prefilled in chunks, mixed with
    the other requests' decode steps."""
    prompts = random_prompts(5, 40, 100, seed=5)
    with make_llm(model_dir, max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY), timeout_s=120)
        # 16 tokens a step: at least this many steps to get through the prompts
        assert stats(llm, C_STAT_STEPS) >= sum(map(len, prompts)) // 16
    for p, o in zip(prompts, outs):
        assert_greedy(ref, p, o.token_ids, ref.greedy(p, 10))


# ------------------------------------------------------------------------ seeded sampling

SEEDED = random_prompts(4, 5, 30, seed=6)


def _sample(llm: LLM, prompts, seeds, n: int = 1, max_tokens: int = 16):
    params = [SamplingParams(temperature=1.0, seed=s, n=n, max_tokens=max_tokens, ignore_eos=True)
              for s in seeds]
    return llm.generate(prompts, params, timeout_s=60)


def test_seeded_sampling_independent_of_batch(llm, tiny_kv_llm):
    [alone] = _sample(llm, [SEEDED[0]], [11])
    batch = _sample(llm, SEEDED, [11, 12, 13, 14])
    reordered = _sample(llm, SEEDED[::-1], [14, 13, 12, 11])
    assert batch[0].token_ids == alone.token_ids
    assert reordered[3].token_ids == alone.token_ids
    assert [o.token_ids for o in batch] == [o.token_ids for o in reordered[::-1]]
    # the same under preemption and recompute (the RNG counter is the token position)
    preempted = stats(tiny_kv_llm, C_STAT_PREEMPTIONS)
    crowded = _sample(tiny_kv_llm, SEEDED * 3, [11, 12, 13, 14] * 3)
    assert stats(tiny_kv_llm, C_STAT_PREEMPTIONS) > preempted
    assert [o.token_ids for o in crowded] == [o.token_ids for o in batch] * 3
    # a sampled continuation is not the greedy one, and another seed gives another one
    [other] = _sample(llm, [SEEDED[0]], [99])
    assert other.token_ids != alone.token_ids


def test_n2_with_seed_two_choices_reproducibly(llm):
    [a] = _sample(llm, [SEEDED[1]], [5], n=2)
    [b] = _sample(llm, [SEEDED[1]], [5], n=2)
    assert [c.index for c in a.outputs] == [0, 1]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_greedy_ignores_seed(llm, ref, greedy_ref):
    outs = llm.generate([PROMPTS[2]] * 2, [SamplingParams(max_tokens=MAX_NEW, seed=s, **GREEDY)
                                           for s in (1, 2)], timeout_s=30)
    for o in outs:
        assert_greedy(ref, PROMPTS[2], o.token_ids, greedy_ref[2])


# ------------------------------------------------------------------------- cancellation


def test_cancel_within_one_step_frees_slot_and_blocks(model_dir):
    """The forward pass is gated so the test decides when each step runs: a cancel written
    while step k is in flight finishes the request at step k+1's scheduling, with no further
    forward pass, and its slot and KV blocks come back."""
    with make_llm(model_dir, max_num_seqs=4) as llm:
        permits = threading.Semaphore(0)
        entered = [0]  # forward passes begun
        real = llm.engine.executor.model.forward

        def gated(*args, **kwargs):
            entered[0] += 1
            permits.acquire(timeout=10)
            return real(*args, **kwargs)

        llm.engine.executor.model.forward = gated
        ring = llm._ring
        prompt = SEEDED[2]
        fields = ring_fields(SamplingParams(max_tokens=200, **GREEDY), len(prompt),
                             llm.max_model_len, ring.config)
        handle = ring.try_submit(ring.new_request_id(), prompt, fields)
        assert handle is not None
        got: list[int] = []

        def poll() -> bool:
            delta = ring.poll(handle)
            if delta is not None:
                got.extend(delta.token_ids)
            return handle.done

        for _ in range(3):
            permits.release()
        wait_for(lambda: (poll(), len(got) >= 3)[1], what="three tokens")
        wait_for(lambda: entered[0] == 4, what="step 4's forward pass")
        assert stats(llm, C_STAT_KV_BLOCKS_USED) > 0
        ring.cancel(handle)  # the engine waits in step 4's forward pass
        permits.release()  # step 4 completes; step 5 must finish the request without a forward
        wait_for(poll, what="the cancelled request to finish")
        assert handle.finish_reason == "abort"
        assert len(got) == 4, got
        assert int(ring._read_field("state", handle.slot, handle.slot + 1)[0]) == SLOT_FREE
        wait_for(lambda: stats(llm, C_STAT_KV_BLOCKS_USED) == 0, what="KV blocks to return")
        assert stats(llm, C_STAT_RUNNING) == 0 and stats(llm, C_STAT_WAITING) == 0

        # cancelled right after being written (before admission, or at it): aborted too
        handle = ring.try_submit(ring.new_request_id(), prompt, fields)
        ring.cancel(handle)
        permits.release()
        wait_for(lambda: (ring.poll(handle), handle.done)[1], what="the request cancelled at once")
        assert handle.finish_reason == "abort"
        wait_for(lambda: stats(llm, C_STAT_KV_BLOCKS_USED) == 0, what="KV blocks to return")

        # the engine still serves
        llm.engine.executor.model.forward = real
        for _ in range(10):
            permits.release()
        [o] = llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY), timeout_s=30)
        assert len(o.token_ids) == 4


# ---------------------------------------------------------------------- output streams


def test_tiny_streams_with_slow_reader_lose_nothing(model_dir, ref):
    prompts = random_prompts(3, 5, 20, seed=7)
    want = [ref.greedy(p, 30) for p in prompts]
    with make_llm(model_dir, stream_capacity=2, max_num_seqs=4) as llm:
        ring = llm._ring
        handles = []
        for p in prompts:
            fields = ring_fields(SamplingParams(max_tokens=30, **GREEDY), len(p),
                                 llm.max_model_len, ring.config)
            handles.append(ring.try_submit(ring.new_request_id(), p, fields))
        got: dict[int, list[int]] = {i: [] for i in range(3)}
        full_reads = 0
        deadline = time.monotonic() + 60
        while not all(h.done for h in handles):
            assert time.monotonic() < deadline, "slow reader timed out"
            time.sleep(0.05)  # slow reader: the engine fills the 2-token streams meanwhile
            for i, h in enumerate(handles):
                delta = ring.poll(h) if not h.done else None
                assert h.error is None, h.error
                if delta is not None:
                    got[i].extend(delta.token_ids)
                    full_reads += len(delta.token_ids) == 2
        assert full_reads > 0, "the streams never filled up"
        for i, p in enumerate(prompts):
            assert handles[i].finish_reason == "length"
            assert_greedy(ref, p, got[i], want[i])
        # and through LLM.generate with the same tiny streams
        outs = llm.generate(prompts, SamplingParams(max_tokens=30, **GREEDY), timeout_s=60)
        for p, o, w in zip(prompts, outs, want):
            assert_greedy(ref, p, o.token_ids, w)


# -------------------------------------------------------------------------- loop thread


def _thread_stat(tid: int) -> tuple[str, float]:
    task = Path(f"/proc/self/task/{tid}")
    comm = (task / "comm").read_text().strip()
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15)
    return comm, ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_loop_thread_named_and_idle_without_spinning(llm):
    llm.generate([SEEDED[0]], SamplingParams(max_tokens=4, **GREEDY), timeout_s=30)
    assert "blink-loop" in {task_name(tid) for tid in task_ids()}  # (None for a thread gone meanwhile)
    tid = llm.engine._thread.native_id
    comm, cpu0 = _thread_stat(tid)
    assert comm == "blink-loop"
    hb0, t0 = llm._ring.engine_status().heartbeat, time.monotonic()
    time.sleep(1.0)
    _, cpu1 = _thread_stat(tid)
    elapsed = time.monotonic() - t0
    assert (cpu1 - cpu0) / elapsed < 0.3, f"idle loop used {(cpu1 - cpu0) / elapsed:.0%} of a core"
    assert llm._ring.engine_status().heartbeat > hb0, "the idle loop stopped beating"


# -------------------------------------------------------------------------------- errors


def test_model_failure_fails_engine_and_generate_raises(model_dir):
    llm = make_llm(model_dir, max_num_seqs=4)
    try:
        def boom(*args, **kwargs):
            raise RuntimeError("injected forward failure")

        llm.engine.executor.model.forward = boom
        t0 = time.monotonic()
        with pytest.raises(BlinkError, match="engine loop stopped.*injected forward failure"):
            llm.generate(SEEDED[:2], SamplingParams(max_tokens=8, **GREEDY), timeout_s=60)
        assert time.monotonic() - t0 < 30
        assert llm._ring.engine_status().state == ENGINE_FAILED
        assert isinstance(llm.engine.error, RuntimeError)
        with pytest.raises(BlinkError, match="engine loop stopped"):  # and stays failed
            llm.generate([SEEDED[0]], SamplingParams(max_tokens=2, **GREEDY), timeout_s=10)
    finally:
        llm.close()


def test_max_model_len_finish_and_too_long_prompts(llm):
    L = llm.max_model_len
    prompt = random_prompts(1, L - 5, L - 5, seed=8)[0]
    for max_tokens in (None, 50):
        [o] = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY), timeout_s=60)
        assert o.finish_reason == "length"
        assert len(o.token_ids) == 5  # stopped by max_model_len, not max_tokens
    for n in (L, L + 40):
        for max_tokens in (None, 8):
            t0 = time.monotonic()
            with pytest.raises(BlinkError, match=f"{n}.*{L}|max_model_len"):
                llm.generate([SEEDED[0], [1] * n], SamplingParams(max_tokens=max_tokens, **GREEDY),
                             timeout_s=30)
            assert time.monotonic() - t0 < 10
    with pytest.raises(BlinkError, match="empty prompt"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    # nothing left behind: the engine is idle and serves the next request
    wait_for(lambda: (llm.engine.ring.state == SLOT_FREE).all(), what="all slots free")
    [o] = llm.generate([SEEDED[0]], SamplingParams(max_tokens=3, **GREEDY), timeout_s=30)
    assert len(o.token_ids) == 3


def test_generate_timeout_is_clear(model_dir):
    """A generate that cannot finish in time raises (never hangs), and its cancelled requests
    are read to the end: the slots come back and the engine goes idle."""
    with make_llm(model_dir, max_num_seqs=4) as llm:
        real = llm.engine.executor.model.forward

        def slow(*args, **kwargs):
            time.sleep(0.3)
            return real(*args, **kwargs)

        llm.engine.executor.model.forward = slow
        t0 = time.monotonic()
        with pytest.raises(BlinkError, match="timed out"):
            llm.generate(SEEDED[:2], SamplingParams(max_tokens=50, **GREEDY), timeout_s=0.5)
        assert time.monotonic() - t0 < 5
        assert (llm.engine.ring.state == SLOT_FREE).all(), llm.engine.ring.state
        assert not llm._ring.active
        llm.engine.executor.model.forward = real
        [o] = llm.generate([SEEDED[1]], SamplingParams(max_tokens=3, **GREEDY), timeout_s=30)
        assert len(o.token_ids) == 3


def test_cpu_loop_bumps_the_heartbeat_between_layers(model_dir):
    """The CPU loop also bumps the heartbeat after each decoder layer, so one long step still
    shows progress: every layer of a step sees a higher heartbeat than the layer before it
    (with only the once-per-step bump, all layers of a step would see the same value)."""
    from blink.ring import C_HEARTBEAT

    with make_llm(model_dir, max_num_seqs=4) as llm:
        layers = llm.engine.executor.model.model.layers
        assert len(layers) >= 2
        control = llm.engine.ring.control
        seen: list[tuple[int, int]] = []  # (layer index, heartbeat when the layer starts)
        for i, layer in enumerate(layers):
            real = layer.forward

            def watched(*args, _i=i, _real=real, **kwargs):
                seen.append((_i, int(control[C_HEARTBEAT])))
                return _real(*args, **kwargs)

            layer.forward = watched
        [o] = llm.generate([SEEDED[0]], SamplingParams(max_tokens=3, **GREEDY), timeout_s=30)
        assert len(o.token_ids) == 3
        steps = [seen[k:k + len(layers)] for k in range(0, len(seen), len(layers))]
        assert len(steps) >= 3 and all([i for i, _ in s] == list(range(len(layers))) for s in steps)
        for s in steps:
            beats = [hb for _, hb in s]
            assert all(b > a for a, b in zip(beats, beats[1:])), beats
    # only while the loop runs: the hook is removed when it stops
    assert llm.engine.executor.model.on_layer is None


def test_engine_builds_on_one_thread_and_the_loop_gets_the_thread_count(model_dir, monkeypatch):
    """Construction runs with one torch thread (a second multi-thread OpenMP team in the
    process would make the loop's workers sleep between ops), the loop thread runs steps with
    the configured count, and the constructing thread's own setting is left as it was."""
    import blink.loader

    during_build: list[int] = []
    real_open = blink.loader.open_model

    def open_model(*args, **kwargs):
        during_build.append(torch.get_num_threads())
        return real_open(*args, **kwargs)

    monkeypatch.setattr(blink.loader, "open_model", open_model)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with make_llm(model_dir, max_num_seqs=4, threads=2) as llm:
            assert during_build == [1]
            assert torch.get_num_threads() == 2  # the caller's setting, restored
            in_step: list[int] = []
            real_execute = llm.engine.executor.execute

            def execute(*args, **kwargs):
                in_step.append(torch.get_num_threads())
                return real_execute(*args, **kwargs)

            llm.engine.executor.execute = execute
            [o] = llm.generate([SEEDED[0]], SamplingParams(max_tokens=2, **GREEDY), timeout_s=30)
            assert len(o.token_ids) == 2 and in_step and set(in_step) == {2}
    finally:
        torch.set_num_threads(before)
