"""CPU graphs (blink.kernels.cpu.graph) and the decode steps replayed from them
(blink.decode_graphs): a replay computes what the eager code computes, to the bit, for every
row count and bucket; padding rows touch nothing but the scratch block; what cannot be
replayed is refused at the recording, and those steps stay eager."""
from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blink.kernels.cpu import fused as cpu_fused, graph as cpu_graph
from blink.kernels.cpu.threads import kernel_threads, set_kernel_threads

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from executor_helpers import build_metadata  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_fused = pytest.mark.skipif(cpu_fused.library() is None, reason="the fused C ops do not build here")


# ------------------------------------------------------------------------------ the recorder


@needs_fused
def test_a_replay_recomputes_from_the_buffers_new_contents():
    x, residual = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    weight = torch.randn(64).bfloat16()
    with torch.inference_mode():
        with cpu_graph.record() as graph:
            out, res_out = cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-5)
        assert [c.name for c in graph.calls] == ["blink_add_rms_norm"]
        x.copy_(torch.randn(5, 64))
        residual.copy_(torch.randn(5, 64))
        want = cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-5)
        assert not torch.equal(out, want[0])  # (the recording's result was of the old inputs)
        graph.replay()
    assert torch.equal(out, want[0]) and torch.equal(res_out, want[1])
    assert graph.kept_bytes >= out.nbytes + res_out.nbytes  # the outputs the calls write into


@needs_fused
def test_a_recording_imports_neither_dynamo_nor_triton():
    """torch wraps every dispatch mode's handler in ``torch._disable_dynamo``, whose first call
    imports torch._dynamo and Triton; the recorder's mode opts out (its nanobind module listed
    hundreds of "leaked" objects as every ``blink serve`` exited). In a fresh process: this one
    has imported both long ago."""
    code = (
        "import sys, torch\n"
        "from blink.kernels.cpu import fused, graph\n"
        "x, w = torch.randn(2, 64).bfloat16(), torch.randn(64).bfloat16()\n"
        "with torch.inference_mode(), graph.record() as g:\n"
        "    fused.rms_norm(x, w, 1e-5)\n"
        "assert [c.name for c in g.calls] == ['blink_add_rms_norm'], g.calls\n"
        "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@needs_fused
def test_a_recording_reuses_memory_the_code_let_go_of():
    """A buffer no tensor refers to any more serves a later allocation (as the eager
    allocator's would: a graph keeps about one layer's activations, not every layer's); a
    buffer still referred to is never handed out; the replay still computes the chain."""
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(64).bfloat16()

    def chain(v):
        for _ in range(4):
            v = cpu_fused.rms_norm(v, w, 1e-5)
        return v

    with torch.inference_mode():
        with cpu_graph.record() as graph:
            a = cpu_fused.rms_norm(x, w, 1e-5)
            b = cpu_fused.rms_norm(a, w, 1e-5)
            a_at = a.data_ptr()
            del a  # let go of
            c = cpu_fused.rms_norm(b, w, 1e-5)
            d = cpu_fused.rms_norm(c, w, 1e-5)
        assert c.data_ptr() == a_at
        assert len({x.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr()}) == 4
        assert graph.kept_bytes == 3 * d.untyped_storage().nbytes()  # a's memory counted once
        x.copy_(torch.randn(4, 64))
        want = chain(x)
        assert not torch.equal(d, want)
        graph.replay()
    assert torch.equal(d, want)


@needs_fused
def test_recording_refuses_torch_ops_that_compute():
    x = torch.randn(4, 64).bfloat16()
    weight = torch.ones(64).bfloat16()
    with torch.inference_mode():
        with pytest.raises(cpu_graph.GraphRecordingError, match="computes with torch"):
            with cpu_graph.record():
                y = cpu_fused.rms_norm(x, weight, 1e-5)
                y + 1  # a replay would not redo this
        with pytest.raises(cpu_graph.GraphRecordingError, match="computes with torch"):
            with cpu_graph.record():
                x.t().contiguous()  # a "view" op that copies here
        with cpu_graph.record() as graph:  # views and allocations are fine
            x.view(2, 128)[:, :64].unsqueeze(0)
            x.reshape(-1)
            torch.empty(3)
        assert graph.calls == []


@needs_fused
def test_recording_refuses_library_functions_it_does_not_know():
    native = cpu_fused.LIBRARY
    with cpu_graph.record():
        assert native.get().blink_has_avx512() in (0, 1)  # a query: called through
    saved = native.kernels
    native.kernels = frozenset()
    try:
        with pytest.raises(cpu_graph.GraphRecordingError, match="neither a kernel nor a query"):
            with cpu_graph.record():
                native.get().blink_add_rms_norm
    finally:
        native.kernels = saved
    assert not isinstance(native.get(), cpu_graph._LibraryView)  # the recording is over


@needs_fused
def test_only_the_recording_thread_sees_the_recorder():
    import threading

    seen = []
    with cpu_graph.record():
        assert isinstance(cpu_fused.LIBRARY.get(), cpu_graph._LibraryView)
        t = threading.Thread(target=lambda: seen.append(cpu_fused.LIBRARY.get()))
        t.start()
        t.join()
    assert seen and not isinstance(seen[0], cpu_graph._LibraryView)


# ------------------------------------------------------------------------------ decode graphs


@pytest.fixture(scope="module")
def executor():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_loader_gguf import smollm_path

    from blink.executor import ModelExecutor

    ex = ModelExecutor(smollm_path(), dtype=torch.bfloat16, num_blocks=400, max_model_len=256)
    if ex.decode_graphs is None or not ex.decode_graphs.record(1):
        pytest.skip(f"decode steps run eagerly here: {ex.decode_graphs and ex.decode_graphs.off_reason}")
    return ex


def _decode_step(ex, contexts: list[int], seed: int):
    """A decode step (one new token per row) over rows whose prompts are already in the cache:
    row r holds ``contexts[r]`` tokens in blocks of its own."""
    g = torch.Generator().manual_seed(seed)
    seqs, first = [], 0
    for n in contexts:
        blocks = -(-(n + 1) // ex.block_size)
        seqs.append(([int(torch.randint(50, 40000, (), generator=g))], n, list(range(first, first + blocks))))
        first += blocks
    assert first <= ex.num_blocks
    return build_metadata(ex, seqs)


def _fill_cache(ex, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for k, v in ex.kv_caches:
        k[:ex.num_blocks].copy_(torch.randn(k[:ex.num_blocks].shape, generator=g))
        v[:ex.num_blocks].copy_(torch.randn(v[:ex.num_blocks].shape, generator=g))


def _eager_and_graph(ex, step):
    """(eager logits, graph logits, eager cache, graph cache) of one step from the same cache."""
    ex.decode_graphs.record(step[0].shape[0])  # a bucket that does not record caps the graphs below it
    if step[0].shape[0] > ex.decode_graphs.max_tokens:  # (e.g. the AVX2 4-bit kernel's 8 rows)
        assert not ex.decode_graphs.takes(step[0], step[1])
        pytest.skip(f"steps of more than {ex.decode_graphs.max_tokens} rows run eagerly here")
    saved = [(k.clone(), v.clone()) for k, v in ex.kv_caches]
    graphs, ex.decode_graphs = ex.decode_graphs, None
    try:
        eager = ex.execute(*step)
    finally:
        ex.decode_graphs = graphs
    eager_cache = [(k[:ex.num_blocks].clone(), v[:ex.num_blocks].clone()) for k, v in ex.kv_caches]
    for (k, v), (k0, v0) in zip(ex.kv_caches, saved):
        k.copy_(k0)
        v.copy_(v0)
    assert graphs.takes(step[0], step[1])
    replayed = ex.execute(*step)
    graph_cache = [(k[:ex.num_blocks], v[:ex.num_blocks]) for k, v in ex.kv_caches]
    return eager, replayed, eager_cache, graph_cache


# every bucket, both sides of each bucket edge, partial buckets
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 12, 13, 16, 17, 23, 24, 31, 32])
def test_a_replayed_decode_step_is_the_eager_step_to_the_bit(executor, rows):
    ex = executor
    _fill_cache(ex, rows)
    contexts = [(7 * r + 3 * rows) % 200 + 1 for r in range(rows)]  # 1..200 keys, unaligned
    eager, replayed, eager_cache, graph_cache = _eager_and_graph(ex, _decode_step(ex, contexts, rows))
    assert replayed.shape == eager.shape == (rows, ex.config.vocab_size) and replayed.dtype == torch.float32
    assert torch.equal(replayed, eager)
    for (ke, ve), (kg, vg) in zip(eager_cache, graph_cache):  # the same K/V written, nothing else
        assert torch.equal(ke, kg) and torch.equal(ve, vg)


def test_a_replayed_step_returns_the_logits_rows_it_was_asked_for_in_their_order(executor):
    """Every token's logits in order (a decode step's indices, 0 .. n-1) is one copy of the
    head's output; any other order of the same rows is gathered: row i is token indices[i]'s."""
    ex = executor
    _fill_cache(ex, 3)
    ids, md, in_order = _decode_step(ex, [9, 40, 17, 3], 3)
    assert torch.equal(in_order, torch.arange(4))
    ex.decode_graphs.record(4)
    assert ex.decode_graphs.takes(ids, md)
    saved = [(k.clone(), v.clone()) for k, v in ex.kv_caches]
    straight = ex.execute(ids, md, in_order)
    for (k, v), (k0, v0) in zip(ex.kv_caches, saved):  # (the same step again: the same cache)
        k.copy_(k0)
        v.copy_(v0)
    shuffled = torch.tensor([2, 0, 3, 1])
    gathered = ex.execute(ids, md, shuffled)
    assert straight.dtype == gathered.dtype == torch.float32
    assert torch.equal(gathered, straight[shuffled])
    assert straight.data_ptr() != ex.decode_graphs.graphs[min(ex.decode_graphs.graphs)].logits.data_ptr()


def test_a_bucket_replays_steps_of_fewer_rows_after_more(executor):
    """Padding rows are reset each replay: 16 rows, then 13 (bucket 16 too), then 16 again."""
    ex = executor
    for rows in (16, 13, 16, 9):
        _fill_cache(ex, 100 + rows)
        eager, replayed, eager_cache, graph_cache = _eager_and_graph(
            ex, _decode_step(ex, [(5 * r + rows) % 150 + 2 for r in range(rows)], rows))
        assert torch.equal(replayed, eager)
        for (ke, ve), (kg, vg) in zip(eager_cache, graph_cache):
            assert torch.equal(ke, kg) and torch.equal(ve, vg)


def test_other_kernel_threads_get_their_own_graph(executor):
    ex = executor
    before = kernel_threads()
    set_kernel_threads(2)
    try:
        _fill_cache(ex, 7)
        eager, replayed, _, _ = _eager_and_graph(ex, _decode_step(ex, [120, 60, 200], 7))
        assert torch.equal(replayed, eager)
        assert (4, 2) in ex.decode_graphs.graphs
    finally:
        set_kernel_threads(before)


def test_steps_that_are_not_plain_decodes_stay_eager(executor):
    ex = executor
    graphs = ex.decode_graphs
    prefill = build_metadata(ex, [([5, 6, 7], 0, [0]), ([8], 4, [1])])
    assert not graphs.takes(prefill[0], prefill[1])  # a row of 3 new tokens
    big = _decode_step(ex, [3] * 33, 0)
    assert not graphs.takes(big[0], big[1])  # above the largest bucket
    step = _decode_step(ex, [3, 4], 0)
    assert graphs.takes(step[0], step[1])
    ex.model.on_layer = lambda: None  # per-layer work (the KV sender's): every layer must run
    try:
        assert not graphs.takes(step[0], step[1])
        beats = []

        def beat() -> None:
            beats.append(1)

        beat.progress_only = True  # the engine's heartbeat: once per replayed step is enough
        ex.model.on_layer = beat
        assert graphs.takes(step[0], step[1])
        ex.execute(*step)
        assert beats == [1]
    finally:
        ex.model.on_layer = None


def test_replayed_steps_leave_one_torch_thread_and_eager_steps_the_loops(executor):
    """With ``eager_threads`` set (the engine's CPU loop), a replayed step sets this thread's
    torch intra-op threads to one for the rest of the step (no OpenMP team spinning on the
    kernels' cores), and an eager forward puts the loop's count back; unset, neither does."""
    ex = executor
    previous = torch.get_num_threads()
    decode = _decode_step(ex, [30, 50], 3)
    prefill = build_metadata(ex, [([5, 6, 7], 0, [0]), ([8], 4, [1])])
    assert ex.decode_graphs.takes(decode[0], decode[1]) and not ex.decode_graphs.takes(prefill[0], prefill[1])
    try:
        torch.set_num_threads(2)
        ex.execute(*decode)
        assert torch.get_num_threads() == 2  # eager_threads unset: the caller's count stays
        ex.eager_threads = 2
        counts = []
        for step in (decode, decode, prefill, decode):
            ex.execute(*step)
            counts.append(torch.get_num_threads())
        assert counts == [1, 1, 2, 1]
        ex.fill_cache(prefill[0], prefill[1])
        assert torch.get_num_threads() == 2
    finally:
        ex.eager_threads = None
        torch.set_num_threads(previous)


def _graph_inputs(ex, rows: int) -> tuple[torch.Tensor, ...]:
    graph = ex.decode_graphs.graphs[(next(b for b in ex.decode_graphs.buckets if b >= rows), kernel_threads())]
    return (graph.embedded.clone(), graph.positions.clone(), graph.slot_mapping.clone(), graph.token_seq_idx.clone(),
            graph.query_start_loc.clone(), graph.seq_lens.clone(), graph.block_tables.clone())


@needs_fused
def test_the_step_inputs_call_writes_what_the_torch_copies_write_and_follows_its_tensors(executor, monkeypatch):
    """A step's inputs written by one C call (cpu_fused.StepInputs) fill the graph's buffers as
    the torch copies do, padding included, for 3 rows in a bucket of 4 after a step of 4 (the
    padding reset); the call made for a shape serves later steps over the same tensors with new
    contents (the CPU loop's buffers), and is made again for other tensors."""
    ex = executor
    ex.decode_graphs.record(4)
    _fill_cache(ex, 7)
    full = _decode_step(ex, [30, 12, 50, 7], 1)
    step = _decode_step(ex, [9, 40, 17], 2)
    _, _, _, _ = _eager_and_graph(ex, full)
    _, replayed_c, _, _ = _eager_and_graph(ex, step)
    inputs_c = _graph_inputs(ex, 3)
    graph = ex.decode_graphs.graphs[(4, kernel_threads())]
    assert graph._writers[(3, 3, step[1].block_tables.shape[1])].serves(*step)
    with monkeypatch.context() as m:
        m.setattr(cpu_fused.StepInputs, "make", classmethod(lambda cls, *a: None))
        graph._writers.clear()
        _fill_cache(ex, 7)  # (the steps' K/V writes change what the next run reads)
        _, _, _, _ = _eager_and_graph(ex, full)
        _, replayed_torch, _, _ = _eager_and_graph(ex, step)
        inputs_torch = _graph_inputs(ex, 3)
    for name, c, t in zip("embedded positions slot_mapping token_seq_idx query_start_loc seq_lens block_tables".split(),
                          inputs_c, inputs_torch):
        assert torch.equal(c, t), (name, c, t)
    assert torch.equal(replayed_c, replayed_torch)
    # the same tensors, new contents: the writer made for them writes them
    _, _, _, _ = _eager_and_graph(ex, step)
    writer = graph._writers[(3, 3, step[1].block_tables.shape[1])]
    later = _decode_step(ex, [5, 44, 20], 3)  # (as many blocks a row as the step)
    ids, md, last = step
    for mine, theirs in ((ids, later[0]), (md.positions, later[1].positions), (md.slot_mapping, later[1].slot_mapping),
                         (md.token_seq_idx, later[1].token_seq_idx), (md.seq_lens, later[1].seq_lens),
                         (md.query_start_loc, later[1].query_start_loc), (md.block_tables, later[1].block_tables)):
        mine.copy_(theirs)
    md.max_context = later[1].max_context
    _, _, _, _ = _eager_and_graph(ex, full)
    eager, replayed, _, _ = _eager_and_graph(ex, step)
    assert graph._writers[(3, 3, md.block_tables.shape[1])] is writer
    assert torch.equal(replayed, eager)
    # other tensors of the same shape: a call of their own
    _, replayed, _, _ = _eager_and_graph(ex, later)
    assert graph._writers[(3, 3, md.block_tables.shape[1])] is not writer


@needs_fused
def test_a_step_with_a_token_id_outside_the_embedding_raises(executor):
    ex = executor
    ids, md, last = _decode_step(ex, [40, 20], 0)
    ids[1] = ex.config.vocab_size + 3
    ex.decode_graphs.record(2)
    assert ex.decode_graphs.takes(ids, md)
    with pytest.raises(IndexError, match="outside the embedding"):
        ex.execute(ids, md, last)


def test_a_replay_with_a_bad_block_id_raises(executor):
    ex = executor
    ids, md, last = _decode_step(ex, [40, 20], 0)
    md.block_tables[1, 0] = ex.num_blocks + 5  # outside the cache
    with pytest.raises(RuntimeError, match="blink_paged_attention failed"):
        ex.execute(ids, md, last)


needs_replay_c = pytest.mark.skipif(cpu_graph.REPLAY.get() is None, reason="replay.c does not build here")


@needs_replay_c
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_c_replay_makes_the_same_calls_as_the_python_one(executor, rows, monkeypatch):
    """replay.c and the Python loop replay the same graphs to the same bits (logits and the
    K/V written), and the C one is what runs when it builds: every call of the step in one."""
    ex = executor
    _fill_cache(ex, 300 + rows)
    step = _decode_step(ex, [(11 * r + 5) % 180 + 1 for r in range(rows)], rows)
    ex.decode_graphs.record(rows)
    saved = [(k.clone(), v.clone()) for k, v in ex.kv_caches]
    c_calls = []
    real = cpu_graph.REPLAY.get()

    class Counting:  # the library, with its one entry point counted
        def blink_replay(self, *args):
            c_calls.append(args[1])
            return real.blink_replay(*args)

    monkeypatch.setattr(cpu_graph.REPLAY, "get", lambda: Counting())
    in_c = ex.execute(*step)
    graph = ex.decode_graphs.graphs[(next(b for b in ex.decode_graphs.buckets if b >= rows), kernel_threads())]
    assert c_calls == [len(graph.layers.calls), len(graph.head.calls)]  # every call, from C
    c_cache = [(k.clone(), v.clone()) for k, v in ex.kv_caches]
    for (k, v), (k0, v0) in zip(ex.kv_caches, saved):
        k.copy_(k0)
        v.copy_(v0)
    monkeypatch.setattr(cpu_graph.REPLAY, "get", lambda: None)  # no compiler: the Python loop
    in_python = ex.execute(*step)
    assert torch.equal(in_c, in_python)
    for (kc, vc), (kp, vp) in zip(c_cache, ex.kv_caches):
        assert torch.equal(kc, kp) and torch.equal(vc, vp)


@needs_replay_c
def test_the_c_replay_stops_at_a_failed_call_and_names_it(executor):
    """The bad block id of test_a_replay_with_a_bad_block_id_raises, replayed in C: the same
    error, and no call after the failed one runs (the head's logits are not rewritten)."""
    ex = executor
    ids, md, last = _decode_step(ex, [40, 20], 1)
    ex.execute(ids, md, last)  # recorded, replayed once
    graph = ex.decode_graphs.graphs[(2, kernel_threads())]
    with torch.inference_mode():
        graph.logits.fill_(7.0)
    md.block_tables[0, 1] = -3  # outside the cache
    with pytest.raises(RuntimeError, match="blink_paged_attention failed with status -1"):
        ex.execute(ids, md, last)
    assert bool((graph.logits == 7.0).all())


def test_recorded_arguments_convert_as_ctypes_converts_them():
    """replay.c's arguments: what ctypes would pass for each declared type (an int truncated
    to a C int, None as a null pointer); a value ctypes would refuse keeps the graph on the
    Python loop."""
    from blink.kernels.cpu import abi

    assert cpu_graph._c_arg(abi.INT, 2**32 + 5).i == 5
    assert cpu_graph._c_arg(abi.INT, -1).i == -1
    assert cpu_graph._c_arg(abi.I64, -2**40).i == -2**40
    assert cpu_graph._c_arg(abi.P, None).p is None
    assert cpu_graph._c_arg(abi.P, ctypes.c_void_p(4096)).p == 4096
    assert cpu_graph._c_arg(abi.P, 8192).p == 8192
    assert cpu_graph._c_arg(abi.F32, 0.5).f == 0.5
    assert cpu_graph._c_arg(abi.P, "text") is None
    assert cpu_graph._c_arg(abi.I64, 1.5) is None
    called = []
    fn = ctypes.CFUNCTYPE(None, ctypes.c_char_p)(lambda text: called.append(text))
    fn.argtypes = [ctypes.c_char_p]
    graph = cpu_graph.CpuGraph()
    graph.calls.append(cpu_graph._Call(fn, (b"x",), "blink_text", False))  # a signature replay.c lacks
    graph.replay()
    assert called == [b"x"] and graph._arrays is False


def test_a_model_with_torch_ops_between_its_kernels_stays_eager(tmp_path):
    """A tiny random HF model's projections are oneDNN's (torch ops): the recording refuses,
    says why, and every step runs eagerly with the same results."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_engine import tiny_model_dir

    from blink.executor import ModelExecutor

    ex = ModelExecutor(tiny_model_dir(tmp_path), dtype=torch.bfloat16, num_blocks=8, max_model_len=64)
    assert ex.decode_graphs is not None and ex.decode_graphs.record(4) == 0
    assert "computes with torch" in ex.decode_graphs.off_reason
    step = build_metadata(ex, [([3], 5, [0]), ([4], 9, [1])])
    assert not ex.decode_graphs.takes(step[0], step[1])
    assert ex.execute(*step).shape[0] == 2


def test_llm_greedy_output_is_the_same_with_and_without_graphs():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from llm_helpers import admit_each_call_at_once
    from test_loader_gguf import smollm_path

    from blink.llm import LLM
    from blink.shared.sampling_params import SamplingParams

    prompts = ["The capital of France is", "Water boils at", "def add(a, b):", "Three colours:"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for graphs in (True, False):
        with LLM(str(smollm_path()), max_num_seqs=4, max_model_len=256, cpu_graphs=graphs) as llm:
            recorded = llm.engine.executor.decode_graphs
            if graphs and (recorded is None or not recorded.graphs):
                pytest.skip("decode steps run eagerly here")
            assert graphs == bool(recorded and recorded.graphs)
            if graphs:
                assert sorted(b for b, _ in recorded.graphs) == [1, 2, 4]  # up to max_num_seqs
            admit_each_call_at_once(llm)
            outputs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]


# ------------------------------------------------------------------------------ verify steps


@pytest.fixture
def verify_graphs(executor):
    """The executor's graphs taking rows of up to K + 1 = 5 positions (the speculative
    runner's setting), put back afterwards."""
    graphs = executor.decode_graphs
    saved = graphs.max_query_len, graphs.buckets, graphs.max_tokens
    graphs.allow_rows_of(5)
    try:
        yield executor
    finally:
        graphs.max_query_len, graphs.buckets, graphs.max_tokens = saved


def _verify_step(ex, drafts: list[int], contexts: list[int], seed: int, lanes: str = "all"):
    """A speculative verify step: row r holds ``contexts[r]`` tokens in the cache and computes
    its last token and a draft of ``drafts[r]`` tokens (1 + drafts[r] positions). ``lanes``:
    the logits asked for, "all" (every position, as a verify step of decode rows) or "first"
    (each row's first position and the draft lanes of row 0 only)."""
    g = torch.Generator().manual_seed(seed)
    seqs, first = [], 0
    for d, n in zip(drafts, contexts):
        blocks = -(-(n + 1 + d) // ex.block_size)
        seqs.append(([int(t) for t in torch.randint(50, 40000, (1 + d,), generator=g)], n,
                     list(range(first, first + blocks))))
        first += blocks
    assert first <= ex.num_blocks
    ids, md, _ = build_metadata(ex, seqs)
    starts = md.query_start_loc.long()
    if lanes == "all":
        want = torch.arange(ids.shape[0])
    else:
        want = torch.cat([torch.arange(int(starts[1])), starts[1:-1]])
    return ids, md, want


# (drafts per row, contexts): one row, several, partial buckets, both sides of each bucket
# edge, rows that do not draft beside rows that do, the 16- and 32-token edges
VERIFY_STEPS = [
    ([4], [37]),
    ([2], [1]),
    ([4, 0], [90, 17]),
    ([0, 3, 1], [5, 64, 200]),
    ([4, 4, 4], [30, 31, 32]),  # 15 tokens
    ([4, 4, 4, 0], [70, 3, 150, 9]),  # 16
    ([4, 4, 4, 1], [70, 3, 150, 9]),  # 17
    ([0] * 12 + [4, 4, 4], [(11 * r) % 180 + 1 for r in range(15)]),  # 27
    ([0] * 12 + [4, 4, 4, 4, 0, 0, 0, 0], [(7 * r) % 200 + 1 for r in range(20)]),  # 32
    # the verify buckets (40 .. 80 tokens), each at its widest padding (one token above the
    # bucket below: a kernel edge inside the bucket would show) and one full
    ([0] * 13 + [4] * 4, [(13 * r) % 200 + 2 for r in range(17)]),  # 33
    ([0] * 11 + [4] * 6, [(5 * r) % 150 + 30 for r in range(17)]),  # 41
    ([4] * 9 + [3], [(17 * r) % 200 + 1 for r in range(10)]),  # 49
    ([4] * 13, [(17 * r) % 200 + 1 for r in range(13)]),  # 65
    ([0] * 5 + [4] * 15, [(3 * r) % 120 + 1 for r in range(20)]),  # 80 of 80
    ([4] * 17, [(7 * r) % 100 + 1 for r in range(17)]),  # 85: eager
]


@pytest.mark.parametrize("drafts,contexts", VERIFY_STEPS)
@pytest.mark.parametrize("lanes", ["all", "first"])
def test_a_replayed_verify_step_is_the_eager_step_to_the_bit(verify_graphs, drafts, contexts, lanes):
    """Rows of several positions replay the same graphs: logits (every lane, or fewer rows
    than tokens: the head then runs eagerly) and K/V as the eager forward's."""
    ex = verify_graphs
    _fill_cache(ex, len(drafts))
    step = _verify_step(ex, drafts, contexts, sum(contexts), lanes)
    if step[0].shape[0] > 80:  # above the largest bucket
        assert not ex.decode_graphs.takes(step[0], step[1])
        return
    assert ex.decode_graphs.takes(step[0], step[1])
    eager, replayed, eager_cache, graph_cache = _eager_and_graph(ex, step)
    assert replayed.shape == eager.shape == (step[2].shape[0], ex.config.vocab_size)
    assert torch.equal(replayed, eager)
    for (ke, ve), (kg, vg) in zip(eager_cache, graph_cache):
        assert torch.equal(ke, kg) and torch.equal(ve, vg)


def test_verify_steps_after_decode_steps_in_one_bucket(verify_graphs):
    """The row split is rewritten each replay: a verify step, a decode step, a verify step
    of another split, all in bucket 8."""
    ex = verify_graphs
    for i, (drafts, contexts) in enumerate([([3, 3], [40, 80]), ([0] * 7, list(range(10, 80, 10))),
                                            ([1, 4, 0], [99, 5, 60])]):
        _fill_cache(ex, 300 + i)
        eager, replayed, eager_cache, graph_cache = _eager_and_graph(ex, _verify_step(ex, drafts, contexts, i))
        assert torch.equal(replayed, eager)
        for (ke, ve), (kg, vg) in zip(eager_cache, graph_cache):
            assert torch.equal(ke, kg) and torch.equal(ve, vg)


def test_verify_steps_replay_only_where_the_eager_step_takes_the_c_attention(executor):
    """Rows of several positions: only once allowed (the speculative runner), at most that
    many per row, and not where the eager step's cost estimate picks SDPA (other bits)."""
    ex = executor
    graphs = ex.decode_graphs
    short = _verify_step(ex, [4, 2], [40, 50], 0)
    assert not graphs.takes(short[0], short[1])  # the default: decode steps only
    saved = graphs.max_query_len
    try:
        graphs.allow_rows_of(3)
        assert not graphs.takes(short[0], short[1])  # a row of 5 positions
        graphs.allow_rows_of(5)
        assert graphs.takes(short[0], short[1])
        # three rows of 5 positions over ~240 keys each: the estimate prefers SDPA
        from blink.kernels.cpu import attention as cpu_attention

        from attention_cases import kernel_threads_as_torchs

        long = _verify_step(ex, [4, 4, 4], [236, 236, 236], 0)
        with kernel_threads_as_torchs():  # (the estimate's figures at equal thread counts)
            assert not cpu_attention.prefer_native(long[1], long[0].shape[0], ex.block_size,
                                                   cpu_attention.tile_min_tokens())
            assert not graphs.takes(long[0], long[1])
        with pytest.raises(ValueError, match="positions"):
            graphs.allow_rows_of(0)
    finally:
        graphs.max_query_len = saved


def test_a_replayed_decode_step_makes_few_torch_calls_on_the_host():
    """The host's part of a replayed decode step (schedule, the graph's inputs, sampler,
    publish) makes at most a few dozen torch calls: each one is microseconds of dispatch, and
    after a step has streamed the weights through the caches each costs several times its warm
    time (a SmolLM2-135M step spent ~0.45 ms of its ~2.5 in host work,
    docs/performance.md#host-torch-calls). The scheduler's batch and compacted metadata and the
    graph's input buffers are views made once per shape, the greedy logprob comes from the
    argmax's pass (20 calls a step then; ~60 before): a change that brings most of them back
    fails here."""
    import sys
    from pathlib import Path

    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(Path(__file__).parent))
    from test_loader_gguf import smollm_path

    import blink.engine.engine as engine_module
    from blink.llm import LLM
    from blink.shared.sampling_params import SamplingParams

    calls: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    step = engine_module.Engine.step
    counted: list[int] = []

    def counting_step(self):
        if len(counted) < 8:  # the prefill and the first decode steps (new shapes) uncounted
            counted.append(0)
            return step(self)
        before = len(calls)
        with Count():
            ran = step(self)
        counted.append(len(calls) - before)
        return ran

    with LLM(str(smollm_path()), max_num_seqs=4, max_model_len=256) as llm:
        graphs = llm.engine.executor.decode_graphs
        if graphs is None or not graphs.graphs:
            pytest.skip("decode steps run eagerly here")
        engine_module.Engine.step = counting_step
        try:
            llm.generate(["The capital of France is"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        finally:
            engine_module.Engine.step = step
    steady = counted[8:]
    assert len(steady) >= 12
    # (a step that finishes the request releases its row: the torch code, once)
    assert sum(n <= 30 for n in steady) >= len(steady) - 2, (steady, sorted(set(calls)))
