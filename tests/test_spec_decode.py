"""Speculative decoding with n-gram drafts (issue 36, blink/engine/speculative.py).

- the draft op (kernels/reference/ngram.py) against a plain-Python per-row rule on random
  histories;
- ``--speculative-config`` parsing: refusals name the field, draft_model by name;
- exactness through the engine (tiny random Llama, fp32): greedy outputs token for token
  the same as without speculation, on repetitive prompts (drafts hit) and random ones
  (they miss), with stop ids and max_tokens inside accepted runs, under preemption, with
  and without the prefix cache; seeded sampled outputs the same too; the KV pool whole at
  quiescence; drafts were proposed and accepted (the counters);
- the acceptance rule for sampled rows, statistically: a chi-square test on a small
  vocabulary over many seeds (accept the point-mass draft x with probability p(x), else a
  draw from p without x) that fails if the rule is wrong.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_engine import Reference, assert_greedy, make_llm, tiny_model_dir, wait_for  # noqa: E402

from blink.engine.speculative import (  # noqa: E402
    SPEC_NUM_ACCEPTED_TOKENS,
    SPEC_NUM_DRAFT_TOKENS,
    SPEC_NUM_DRAFTS,
)
from blink.errors import BlinkError  # noqa: E402
from blink.kernels.reference.ngram import ngram_propose, ngram_propose_python  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402
from blink.shared.speculative_config import (  # noqa: E402
    SpeculativeConfigError,
    parse_speculative_config,
)

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


# ------------------------------------------------------------------------------ draft op


@pytest.mark.parametrize("seed", range(6))
def test_ngram_propose_matches_python(seed):
    rng = random.Random(seed)
    R, L, K = 24, 48, rng.choice([1, 3, 5])
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 4)
    vocab = rng.choice([2, 3, 5, 50])  # small vocabularies: many matches
    histories = [[rng.randrange(vocab) for _ in range(rng.randint(0, L))] for _ in range(R)]
    tokens = torch.full((R, L + 1), 7, dtype=torch.int32)  # garbage past each row's length
    for r, h in enumerate(histories):
        tokens[r, : len(h)] = torch.tensor(h, dtype=torch.int32)
    lengths = torch.tensor([len(h) for h in histories])
    draft, dlen = ngram_propose(tokens, lengths, K, lo, hi)
    for r, h in enumerate(histories):
        want = ngram_propose_python(h, K, lo, hi)
        got = draft[r, : int(dlen[r])].tolist()
        assert got == want, (r, h, lo, hi, K)
        assert bool((draft[r, int(dlen[r]):] == 0).all())
    # a larger minimum n per row (rows whose drafts keep missing), passes below lo skipped too
    row_min = torch.tensor([rng.randint(lo, hi) for _ in range(R)])
    draft, dlen = ngram_propose(tokens, lengths, K, int(row_min.min()), hi, row_min)
    for r, h in enumerate(histories):
        assert draft[r, : int(dlen[r])].tolist() == ngram_propose_python(h, K, int(row_min[r]), hi), r


def test_ngram_latest_occurrence_longest_n():
    h = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    # "2 3" occurs at 1 and 5; latest is 5 -> 8 5 2 3; the 3-gram "5 2 3" does not occur earlier
    assert ngram_propose_python(h, 4, 1, 3) == [8, 5, 2, 3]
    tokens = torch.tensor([h])
    draft, n = ngram_propose(tokens, torch.tensor([len(h)]), 4, 1, 3)
    assert draft[0, : int(n[0])].tolist() == [8, 5, 2, 3]


# ------------------------------------------------------------------------------ config


def test_config_parsing():
    cfg = parse_speculative_config(SPEC)
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 1, 3)
    assert parse_speculative_config(None) is None
    from blink.ring import SPEC_POSITIONS
    from blink.shared.speculative_config import MAX_SPECULATIVE_TOKENS

    assert MAX_SPECULATIVE_TOKENS <= SPEC_POSITIONS  # the ring's per-position words
    bad = {
        '{"method": "draft_model", "num_speculative_tokens": 2}': "'model'",  # tests/test_spec_draft_model.py
        '{"method": "eagle", "num_speculative_tokens": 2}': "'method'",
        '{"method": "ngram"}': "'num_speculative_tokens'",
        '{"method": "ngram", "num_speculative_tokens": 0}': "'num_speculative_tokens'",
        '{"method": "ngram", "num_speculative_tokens": "3"}': "'num_speculative_tokens'",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}':
            "'prompt_lookup_min'",
        '{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}': "'foo'",
        "not json": "not JSON",
    }
    for text, word in bad.items():
        with pytest.raises(SpeculativeConfigError, match=word):
            parse_speculative_config(text)


def test_flag_declared_once_and_forwarded():
    import argparse

    from blink.engine_options import add_engine_options, engine_config_kwargs, forwarded_argv

    p = argparse.ArgumentParser()
    add_engine_options(p)
    args = p.parse_args(["--speculative-config", SPEC])
    assert engine_config_kwargs(args)["speculative_config"] == SPEC
    argv = forwarded_argv(args)
    assert argv[argv.index("--speculative-config") + 1] == SPEC
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", '{"method": "draft_model"}'])


def test_every_runner_takes_the_flag():
    """Every runner verifies drafts now: the eager CPU loop (CPU graphs for steps with no
    draft), --compile, and the GPU tiers (their captured verify phase)."""
    from blink.engine.runners import choose_step_runner

    for loop, name in (("host", "tier-a"), ("device", "tier-b")):
        assert choose_step_runner(loop=loop, device="cuda", enforce_eager=True, cpu_graphs=False,
                                  speculative=True).name == name
    assert choose_step_runner(loop="cpu", device="cpu", enforce_eager=False, cpu_graphs=False,
                              speculative=True).name == "compiled"
    assert choose_step_runner(loop="cpu", device="cpu", enforce_eager=True, cpu_graphs=True,
                              speculative=True).name == "cpu-graphs"
    assert choose_step_runner(loop="cpu", device="cpu", enforce_eager=True, cpu_graphs=False,
                              speculative=True).name == "eager"


# ------------------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("spec_models"))


def _repetitive(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        unit = [rng.randrange(256) for _ in range(rng.randint(3, 8))]
        out.append((unit * 12)[: rng.randint(20, 60)])
    return out


def _random(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(n)]


PROMPTS = _repetitive(1, 6) + _random(2, 4)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _pool_whole(llm) -> None:
    sched = llm.engine.scheduler
    wait_for(lambda: not sched.has_pending_release() and int((sched.state.block_ref > 0).sum()) == 0,
             what="the KV pool whole again")
    assert int(sched.state.num_blocks.sum()) == 0


@pytest.fixture(scope="module")
def plain(model_dir):
    with make_llm(model_dir, cpu_graphs=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def spec(model_dir):
    with make_llm(model_dir, speculative_config=SPEC) as engine:
        yield engine


def test_greedy_identical_and_drafts_accepted(plain, spec):
    assert type(spec.engine.runner).__name__ == "SpecCpuGraphsRunner"  # --cpu-graphs auto
    params = SamplingParams(max_tokens=40, **GREEDY)
    want = plain.generate(PROMPTS, params, timeout_s=120)
    before = spec.engine.scheduler.spec_counters.clone()
    got = spec.generate(PROMPTS, params, timeout_s=120)
    for p, w, g in zip(PROMPTS, want, got):
        assert g.token_ids == w.token_ids, p
        assert g.finish_reason == w.finish_reason == "length"
    c = spec.engine.scheduler.spec_counters - before
    assert int(c[SPEC_NUM_DRAFTS]) > 0 and int(c[SPEC_NUM_DRAFT_TOKENS]) >= int(c[SPEC_NUM_DRAFTS])
    assert int(c[SPEC_NUM_ACCEPTED_TOKENS]) > 0, "no draft token was ever accepted"
    # one at a time too (a batch of one is where speculation pays)
    for i in (0, 7):
        [g] = spec.generate([PROMPTS[i]], params, timeout_s=60)
        assert g.token_ids == want[i].token_ids
    _pool_whole(spec)


def test_greedy_matches_transformers(spec):
    """The parity check of tests/test_engine.py with speculation on: transformers' own greedy
    continuation of the same fp32 model."""
    ref = Reference()
    params = SamplingParams(max_tokens=24, **GREEDY)
    prompts = PROMPTS[:3] + PROMPTS[7:]
    for p, o in zip(prompts, spec.generate(prompts, params, timeout_s=120)):
        assert_greedy(ref, p, o.token_ids, ref.greedy(p, 24))


def test_stop_ids_and_max_tokens_inside_accepted_runs(plain, spec):
    base = plain.generate(PROMPTS[:6], SamplingParams(max_tokens=40, **GREEDY), timeout_s=120)
    params = []
    for b in base:  # stop at a token met mid-run, and max_tokens at odd places
        params.append(SamplingParams(max_tokens=40, stop_token_ids=[b.token_ids[9]], **GREEDY))
    for mt in (1, 2, 3, 5, 7, 13):
        params.append(SamplingParams(max_tokens=mt, **GREEDY))
    prompts = PROMPTS[:6] + PROMPTS[:6]
    want = plain.generate(prompts, params, timeout_s=120)
    got = spec.generate(prompts, params, timeout_s=120)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
    _pool_whole(spec)


def test_seeded_sampling_identical(plain, spec):
    params = [SamplingParams(temperature=0.7, seed=s, max_tokens=32, ignore_eos=True, logprobs=2)
              for s in range(len(PROMPTS))]
    want = plain.generate(PROMPTS, params, timeout_s=120)
    got = spec.generate(PROMPTS, params, timeout_s=120)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        # the accepted tokens' logprobs (and top-2) are the ones the plain step gives
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    _pool_whole(spec)


def test_penalties_bias_min_tokens_bad_words_identical(plain, spec):
    """Sampler stages that read the row's history or output count: each lane sees the
    draft tokens before it, so the result is the plain step's."""
    params = []
    for i, p in enumerate(PROMPTS):
        params.append(SamplingParams(
            max_tokens=30, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=False,
            repetition_penalty=1.3 if i % 3 == 0 else 1.0, presence_penalty=0.5 if i % 3 == 1 else 0.0,
            frequency_penalty=0.4 if i % 3 == 2 else 0.0, logit_bias={p[0]: 2.0, p[-1]: -1.0},
            min_tokens=5, stop_token_ids=[p[1]], bad_words_token_ids=[[p[2], p[3]]] if len(p) > 3 else None))
    want = plain.generate(PROMPTS, params, timeout_s=120)
    got = spec.generate(PROMPTS, params, timeout_s=120)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
    _pool_whole(spec)


def test_constrained_rows_do_not_speculate(plain, spec):
    """A structured-output row (a token mask per step) never drafts; next to drafting rows it
    is masked and sampled as without speculation, and the others stay exact."""
    import re

    from blink.shared.structured_outputs import StructuredOutputs

    rx = "[a-d]{2,8}!"
    params = [SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputs(regex=rx)),
              SamplingParams(max_tokens=12, temperature=1.0, seed=3, structured_outputs=StructuredOutputs(regex=rx)),
              SamplingParams(max_tokens=30, **GREEDY), SamplingParams(max_tokens=30, **GREEDY)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    want = plain.generate(prompts, params, timeout_s=120)
    got = spec.generate(prompts, params, timeout_s=120)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
    for g in got[:2]:
        assert re.fullmatch(rx, g.outputs[0].text.rstrip("\x00")), g.outputs[0].text
    _pool_whole(spec)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_identical_under_preemption(model_dir, prefix_caching):
    prompts = PROMPTS * 2
    params = SamplingParams(max_tokens=48, **GREEDY)
    small = dict(max_model_len=128, kv_cache_tokens=160, enable_prefix_caching=prefix_caching)
    with make_llm(model_dir, cpu_graphs=False, **small) as plain_llm:
        want = plain_llm.generate(prompts, params, timeout_s=180)
    with make_llm(model_dir, speculative_config=SPEC, **small) as spec_llm:
        got = spec_llm.generate(prompts, params, timeout_s=180)
        _pool_whole(spec_llm)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids


def _tier_llm(model_dir, loop: str, **overrides):
    """An LLM whose engine runs GPU tier ``loop`` (host: A, device: B) under the host
    simulation (the captured functions run eager on CPU tensors)."""
    from blink import llm as llm_module
    from blink.engine.factory import create_engine
    from blink.engine.gpu import host_sim

    orig = llm_module.create_engine
    llm_module.create_engine = lambda cfg, _loop="auto", **_kw: create_engine(
        cfg, loop, simulation=host_sim.HostSimulation())
    try:
        return make_llm(model_dir, max_num_batched_tokens=64, device="cpu", **overrides)
    finally:
        llm_module.create_engine = orig


TIER_GREEDY = SamplingParams(max_tokens=32, **GREEDY)


@pytest.fixture(scope="module")
def eager_counts(model_dir):
    """The CPU loop's spec counters (drafts, draft tokens, accepted; accepted per position)
    for the greedy prompts on a fresh engine with the tiers' token budget."""
    with make_llm(model_dir, max_num_batched_tokens=64, cpu_graphs=False, speculative_config=SPEC) as llm:
        llm.generate(PROMPTS, TIER_GREEDY, timeout_s=120)
        sched = llm.engine.scheduler
        return sched.spec_counters.tolist(), sched.spec_accepted_per_pos.tolist()


@pytest.mark.parametrize("loop", ["host", "device"])
def test_gpu_tiers_exact(model_dir, plain, eager_counts, loop):
    """Tier A and B (simulated) verify drafts in the captured step (spec_model_phase: the
    fixed [rows, K+1] lane grid): greedy token for token as without speculation, seeded
    sampling the same, stop ids and max_tokens inside accepted runs; the KV pool whole. The
    counters equal the CPU loop's on the same greedy run: its host-side draft eligibility
    and the captured tensor rule (back-off included: the random prompts' drafts miss) agree."""
    greedy = TIER_GREEDY
    seeded = [SamplingParams(temperature=0.7, seed=s, max_tokens=24, ignore_eos=True, logprobs=2)
              for s in range(len(PROMPTS))]
    base = plain.generate(PROMPTS[:6], greedy, timeout_s=120)
    cut = [SamplingParams(max_tokens=40, stop_token_ids=[b.token_ids[9]], **GREEDY) for b in base]
    cut += [SamplingParams(max_tokens=mt, **GREEDY) for mt in (1, 2, 3, 5, 7, 13)]
    jobs = [(PROMPTS, greedy), (PROMPTS, seeded), (PROMPTS[:6] * 2, cut)]
    wants = [plain.generate(p, q, timeout_s=120) for p, q in jobs]
    with _tier_llm(model_dir, loop, speculative_config=SPEC) as llm:
        assert llm.engine.runner.name == ("tier-a" if loop == "host" else "tier-b")
        before = llm.engine.scheduler.spec_counters.clone()
        for i, ((prompts, params), want) in enumerate(zip(jobs, wants)):
            got = llm.generate(prompts, params, timeout_s=240)
            for w, g in zip(want, got):
                assert g.token_ids == w.token_ids
                assert g.finish_reason == w.finish_reason
            if i == 0:
                sched = llm.engine.scheduler
                assert (sched.spec_counters.tolist(), sched.spec_accepted_per_pos.tolist()) == eager_counts
        c = llm.engine.scheduler.spec_counters - before
        assert int(c[SPEC_NUM_ACCEPTED_TOKENS]) > 0, "no draft token was ever accepted"
        if loop == "host":
            _pool_whole(llm)
        else:  # tier B releases a finished row's blocks in a later step, if one comes (its
            # loop runs on: a step may release them while this reads): only RELEASING rows hold
            # blocks, exactly the ones they own, read from one state between steps. A block
            # leaked or held twice never satisfies it, and the wait fails.
            from blink.engine.sched.state import ROW_RELEASING, ROW_RUNNING, ROW_WAITING

            st = llm.engine.scheduler.state
            wait_for(lambda: not bool(((st.status == ROW_RUNNING) | (st.status == ROW_WAITING)).any()),
                     what="no live row")

            def only_releasing_rows_hold_blocks() -> bool:
                held = int(st.num_blocks[st.status == ROW_RELEASING].sum())
                return int((st.block_ref > 0).sum()) == held and int(st.num_blocks.sum()) == held

            wait_for(only_releasing_rows_hold_blocks, what="blocks held by RELEASING rows only")


def test_decode_engine_of_a_disaggregated_pair_speculates(model_dir):
    """Disaggregation (docs/disaggregation.md): a decode engine with --speculative-config
    takes the prompt's KV from a prefill engine and then drafts over the row's history
    (prompt included); greedy outputs are the colocated plain engine's, drafts were
    accepted, and both engines hold nothing at the end."""
    from test_disaggregation import SECRET, _assert_nothing_held, _config, _disaggregated

    from blink.dpu.ring_protocol import RingClient
    from blink.engine.engine import Engine
    from blink.transport import BootstrapServer, LoopbackTransport

    decode = Engine(_config(model_dir, role="decode", speculative_config=SPEC))
    server = BootstrapServer(decode.region, model_name="m", max_model_len=decode.max_model_len,
                             tokenizer="t", secret=SECRET, kv_region=decode.kv_region,
                             kv_layout=decode.kv_layout.to_dict(), extra={"engine_role": "decode"})
    host, port = server.start()
    prefill = Engine(_config(model_dir, role="prefill", kv_peers=(f"{host}:{port}",)))
    prefill.attach_kv_peers(SECRET)
    engines = {"decode": decode, "prefill": prefill}
    try:
        for e in (decode, prefill):
            e.start()
        engines["clients"] = {name: RingClient(LoopbackTransport(e.region.name, e.region.total_bytes))
                              for name, e in (("decode", decode), ("prefill", prefill))}
        with make_llm(model_dir, cpu_graphs=False, block_size=8) as plain_llm:
            for prompt in PROMPTS[:4]:
                want = plain_llm.generate([prompt], SamplingParams(max_tokens=20, **GREEDY), timeout_s=60)[0]
                assert _disaggregated(engines, prompt, 20) == want.token_ids, prompt
        assert int(decode.scheduler.spec_counters[SPEC_NUM_ACCEPTED_TOKENS]) > 0
        _assert_nothing_held(engines)
    finally:
        for c in engines.get("clients", {}).values():
            c.close()
        server.stop()
        for e in (prefill, decode):
            e.close()


def test_invalid_config_refused_by_engine(model_dir):
    with pytest.raises(BlinkError, match="draft_model 'model' 'x'"):  # no such file
        make_llm(model_dir, speculative_config='{"method": "draft_model", "model": "x", "num_speculative_tokens": 2}')


# ------------------------------------------------------------------------------ sampling rule


def test_acceptance_rule_chi_square():
    """One sampled lane with a point-mass draft x: the engine's rule (draw t from p with the
    lane's seed and counter; accept x iff t == x, else publish t) must give P(accept) = p(x)
    and, when rejected, p without x renormalised; so the first published token ~ p. Checked
    with chi-square statistics over many seeds; a wrong rule (e.g. always accepting the
    draft, or resampling from p including x) fails."""
    from blink.engine.sampler import Sampler, SamplingTensors

    V, draws = 6, 6000
    probs = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    logits = probs.log().unsqueeze(0).expand(draws, V).contiguous()
    x = 2  # the draft token
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=s) for s in range(draws)])
    n = torch.full((draws,), 10, dtype=torch.int64)
    history = torch.zeros(draws, 16, dtype=torch.int32)
    out = Sampler(max_logprobs=1)(logits, st, history, n, n, n)
    t = out.tokens.long()
    accepted = t == x
    first = torch.where(accepted, x, t)  # the published token at this position
    counts = torch.bincount(first, minlength=V).double()
    expect = probs.double() * draws
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 20.5, f"chi-square {chi2:.1f} (5 dof, p=0.001) — published tokens are not ~ p"
    # acceptance probability is p(x)
    acc = float(accepted.double().mean())
    assert abs(acc - 0.25) < 4 * (0.25 * 0.75 / draws) ** 0.5
    # residual distribution: p without x renormalised
    rej = torch.bincount(t[~accepted], minlength=V).double()
    q = probs.clone().double()
    q[x] = 0
    q /= q.sum()
    exp_r = q * float((~accepted).sum())
    keep = q > 0
    chi2_r = float((((rej - exp_r) ** 2)[keep] / exp_r[keep]).sum())
    assert chi2_r < 18.5 and rej[x] == 0
    # the same statistic catches a wrong rule: always accepting the draft
    wrong = torch.full_like(first, x)
    wrong_counts = torch.bincount(wrong, minlength=V).double()
    assert float(((wrong_counts - expect) ** 2 / expect).sum()) > 1000


# ------------------------------------------------------------------------------ metrics


def test_counters_reach_ring_and_metrics(spec, plain):
    """The scheduler's counters are mirrored into the ring's control block, and /metrics
    shows them under vLLM's names (only when speculation is on)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from blink.dpu.metrics import _EngineStatsCollector
    from blink.ring import (
        C_SPEC_TOKENS,
        C_STAT_SPEC_ACCEPTED_PER_POS,
        C_STAT_SPEC_ACCEPTED_TOKENS,
        C_STAT_SPEC_DRAFT_TOKENS,
        C_STAT_SPEC_DRAFTS,
    )

    spec.generate(PROMPTS[:2], SamplingParams(max_tokens=16, **GREEDY), timeout_s=60)
    c = spec._ring.engine_status().control
    counters = spec.engine.scheduler.spec_counters
    assert int(c[C_SPEC_TOKENS]) == 4
    assert [int(c[w]) for w in (C_STAT_SPEC_DRAFTS, C_STAT_SPEC_DRAFT_TOKENS, C_STAT_SPEC_ACCEPTED_TOKENS)] == \
        counters.tolist()
    assert int(plain._ring.engine_status().control[C_SPEC_TOKENS]) == 0
    per_pos = spec.engine.scheduler.spec_accepted_per_pos
    assert [int(v) for v in c[C_STAT_SPEC_ACCEPTED_PER_POS: C_STAT_SPEC_ACCEPTED_PER_POS + 4]] == per_pos.tolist()
    assert int(per_pos[0]) >= int(per_pos[-1]) and int(per_pos.sum()) == int(counters[2])

    base = dict(running=0, waiting=0, kv_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0)

    class Engine:
        def __init__(self, extra):
            self.extra = extra

        def stats(self):
            return {**base, **self.extra}

    def scrape(extra) -> str:
        reg = CollectorRegistry()
        reg.register(_EngineStatsCollector(Engine(extra), "m"))
        return generate_latest(reg).decode()

    text = scrape(dict(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=9, spec_decode_num_accepted_tokens=4,
                       spec_decode_num_accepted_tokens_per_pos=[3, 1, 0]))
    assert 'blink:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    assert 'blink:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'blink:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'blink:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0' in text
    assert "spec_decode" not in scrape({})
