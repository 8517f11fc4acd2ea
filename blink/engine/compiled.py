"""Compiled steps for the CPU loop: the counterpart of the GPU tiers' per-bucket CUDA graphs.

``torch.compile`` (inductor) with static shapes per token bucket. What is compiled:

- one **decoder layer** per token bucket, shared by all layers (their weights are graph
  inputs, the code and shapes are the same), so a bucket costs one trace, not thirty;
- the **head** (final norm, LM head) per sample-row bucket, and the **sampler** per row bucket
  and sampler plan (greedy, and random without filters or penalties, the two defaults; other
  plans run the same code eager), with inductor options of its own
  (:data:`SAMPLER_COMPILE_OPTIONS`: its compile time);
- the **paged attention kernel** (:mod:`blink.kernels.cpu.paged_attention`) once, with
  dynamic shapes. Attention itself is an opaque custom op in the layer graph
  (:mod:`blink.kernels.cpu.step_ops`), because its work depends on the step's values.

Everything compiles at start (a progress line per bucket); the compiled code persists in
inductor's FX graph cache under :func:`compile_cache_dir`, so a second start mostly loads it.
In steady state nothing may compile again: calls run under ``fail_on_recompile``, and a
call that would recompile runs eager instead (counted in :attr:`CompiledFn.refused`, with a
one-line warning). If compilation fails, a one-line warning says so and that part runs
eager: nothing is lost. ``--enforce-eager`` (``EngineConfig.enforce_eager``) turns all of
this off.

:func:`compile_fn` is the one wrapper for all of it (cache, progress, fallback, recompile
policy); the scheduler's stages can use it the same way.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from blink.engine.sampler import Sampler, SamplerPlan, SamplingTensors
from blink.engine.sched.state import bucket_for, geometric_buckets
from blink import env as blink_env
from blink.errors import BlinkError

#: environment: "1" = run eager (the default of ``EngineConfig.enforce_eager``)
ENFORCE_EAGER_ENV = "BLINK_ENFORCE_EAGER"
#: environment: where compiled code is cached (``--compile-cache-dir`` wins)
CACHE_DIR_ENV = "BLINK_COMPILE_CACHE_DIR"

# The sampler plans compiled at start: greedy, and temperature sampling without filters,
# penalties, top logprobs or structured outputs (the API's defaults). Others run eager (the
# same code; a constrained batch passes its token masks, which the compiled head does not take).
_DEFAULTS = dict(any_filter=False, any_penalty=False, any_top_logprobs=False,
                 any_logit_bias=False, any_suppress=False, any_constrained=False,
                 any_allowed=False, any_bad_words=False)
WARM_PLANS = (SamplerPlan(any_random=False, **_DEFAULTS), SamplerPlan(any_random=True, **_DEFAULTS))

Progress = Callable[[str], None]


def enforce_eager_default() -> bool:
    """``EngineConfig.enforce_eager``'s default: ``$BLINK_ENFORCE_EAGER`` when set, else True
    (eager): on the CPUs measured so far the compiled steps were not faster than eager
    (docs/performance.md#compiled), and a first compiled start takes minutes.
    ``--compile`` (or ``BLINK_ENFORCE_EAGER=0``) opts in."""
    return (blink_env.get(ENFORCE_EAGER_ENV) or "1").strip().lower() not in ("0", "false", "no")


def compile_cache_dir(configured: str | os.PathLike | None = None) -> Path:
    """Where inductor keeps compiled code: ``configured`` (``--compile-cache-dir``), else
    ``$BLINK_COMPILE_CACHE_DIR``, else ``$XDG_CACHE_HOME/blink/inductor`` (``~/.cache``)."""
    if configured:
        return Path(configured).expanduser()
    if blink_env.get(CACHE_DIR_ENV):
        return Path(blink_env.get(CACHE_DIR_ENV)).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "blink" / "inductor"


#: the subdirectory of the compile cache this Blink reads and writes: a new one whenever what
#: Blink hands compiled code changes in a way inductor's cache key misses. (When the KV caches
#: became tensors of their own instead of views into 2 MB-page chunks, an entry of the views'
#: kernel code loaded for the new caches and crashed the process: a segfault at start.)
CACHE_LAYOUT = "layout-2"


def configure_compile_cache(path: Path) -> None:
    """Point inductor's persistent caches (FX graph cache, compiled kernels) at ``path``'s
    :data:`CACHE_LAYOUT` subdirectory. Must run before the first compilation of the process."""
    path = path / CACHE_LAYOUT
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BlinkError(f"--compile-cache-dir {path}: cannot create it ({exc.strerror})") from None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    # Buckets of one function are separate graphs of one code object (plus the lead's
    # scheduler stages): dynamo's default limit of 8 would silently drop to eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 1024
    )


#: free space the compile cache needs for one start's graphs (inductor's generated C++ and
#: Python, and their builds: tens of MiB for a small model's buckets)
COMPILE_CACHE_MIN_FREE_MB = 256
#: path -> why it cannot be used (None: it can), decided once per process
_cache_problems: dict[str, str | None] = {}


def _cache_problem(path: Path) -> str | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        stat = os.statvfs(path)
        free_mb = stat.f_bavail * stat.f_frsize / 2**20
        if free_mb < COMPILE_CACHE_MIN_FREE_MB:
            return (f"has {free_mb:.0f} MiB free (compiling needs about "
                    f"{COMPILE_CACHE_MIN_FREE_MB} MiB)")
        probe = path / f".blink-probe-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 65536)
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc})"
    return None


def usable_compile_cache(path: Path, log: Any) -> bool:
    """Whether inductor can write compiled code under ``path``: it can be created and
    written, with at least :data:`COMPILE_CACHE_MIN_FREE_MB` free. Checked once per path and
    process; a failure is said once (on ``log``) and remembered for this start, and the
    caller runs eager instead of meeting the same full disk in every bucket's compile."""
    key = str(path)
    if key not in _cache_problems:
        _cache_problems[key] = problem = _cache_problem(path)
        if problem is not None:
            log.warning("--compile: the compile cache %s %s; for the rest of this start every "
                        "step runs eager (the same outputs). Free space there or give another "
                        "--compile-cache-dir", path, problem)
    return _cache_problems[key] is None


_warming = threading.local()


@contextlib.contextmanager
def warming() -> Iterator[None]:
    """While compiling at start, every :class:`CompiledFn` call may compile (functions called
    from inside others', like the attention kernel inside the layer's attention op, compile
    on their first call there: dynamo guards the dispatcher state they run under)."""
    previous = getattr(_warming, "on", False)
    _warming.on = True
    try:
        yield
    finally:
        _warming.on = previous


def stderr_progress(message: str) -> None:
    print(f"blink: {message}", file=sys.stderr, flush=True)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


class CompiledFn:
    """``fn`` compiled with inductor, with Blink's policy around it (see the module doc).

    Call :meth:`warm` with example inputs at start, once per shape (bucket) that will be
    used; it compiles, or on failure warns once and makes every later call eager. Plain
    calls then never compile: one that would is refused (``fail_on_recompile``), counted in
    :attr:`refused` and run by ``fallback`` (default: ``fn`` itself, eager) instead.
    ``context`` (optional) is entered around every compiled call and warm-up.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        *,
        fallback: Callable[..., Any] | None = None,
        context: Callable[[], contextlib.AbstractContextManager] | None = None,
        **options: Any,
    ) -> None:
        self.fn = fn
        self.name = name
        self.fallback = fallback or fn
        self.context = context or contextlib.nullcontext
        options.setdefault("dynamic", False)
        options.setdefault("fullgraph", True)
        self.compiled = torch.compile(fn, **options)
        self.failed: str | None = None  # why compilation failed, if it did
        self.refused = 0  # steady-state calls that would have recompiled

    def warm(self, *args: Any, **kwargs: Any) -> bool:
        """Compile for these inputs' shapes and run once. False (after a one-line warning)
        if compilation failed; everything then runs eager."""
        if self.failed is not None:
            return False
        try:
            with self.context(), warming():
                self.compiled(*args, **kwargs)
                # Once more: dynamo guards the dispatcher state of the inputs, which can differ
                # between the compiling call and later ones; a second entry covers those.
                self.compiled(*args, **kwargs)
            return True
        except Exception as exc:  # any compiler failure: eager continues, nothing lost
            self.failed = _one_line(exc)
            print(f"blink: warning: compiling {self.name} failed ({self.failed}); running it eager",
                  file=sys.stderr, flush=True)
            return False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is not None:
            return self.fallback(*args, **kwargs)
        if getattr(_warming, "on", False):
            try:
                with self.context():
                    return self.compiled(*args, **kwargs)
            except Exception as exc:
                self.failed = _one_line(exc)
                print(f"blink: warning: compiling {self.name} failed ({self.failed}); running it "
                      "eager", file=sys.stderr, flush=True)
                return self.fallback(*args, **kwargs)
        try:
            with self.context(), torch.compiler.set_stance("fail_on_recompile"):
                return self.compiled(*args, **kwargs)
        except RuntimeError as exc:
            if not _is_refused_recompile(exc):
                raise
            self.refused += 1
            if self.refused == 1:
                reasons = [line.strip() for line in str(exc).splitlines() if line.strip().startswith("- ")]
                why = " | ".join(r[2:] for r in reasons) if reasons else _one_line(exc)
                print(f"blink: warning: {self.name} would recompile in steady state ({why[:500]}); "
                      "running such calls eager", file=sys.stderr, flush=True)
        return self.fallback(*args, **kwargs)


def _is_refused_recompile(exc: BaseException) -> bool:
    """What ``set_stance("fail_on_recompile")`` raises (a plain RuntimeError in torch 2.13)."""
    return isinstance(exc, torch._dynamo.exc.RecompileError) or str(exc).startswith(
        "Detected recompile when torch.compile stance is 'fail_on_recompile'"
    )


def compile_fn(fn: Callable[..., Any], name: str, **options: Any) -> CompiledFn:
    """:class:`CompiledFn` of ``fn``: the one way Blink compiles a step function."""
    return CompiledFn(fn, name, **options)


def token_buckets(scheduler_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The CPU loop's token buckets: 1, 2 and 4 below the scheduler's (a decode of a few
    rows should not pay for 8 tokens), then the scheduler's own."""
    budget = scheduler_buckets[-1]
    return tuple(sorted({*(b for b in (1, 2, 4) if b < budget), *scheduler_buckets}))


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Sample-row buckets: powers of four up to ``max_rows``, and ``max_rows``. Coarser than
    the token buckets: a padding row costs only its LM-head row and sampler work, and every
    bucket is two graphs (two sampler plans) to compile at start."""
    return geometric_buckets(1, 4, max_rows)


# ------------------------------------------------------------------ the compiled functions


def _decoder_layer(layer, x, residual, md, kv_cache, cos_sin):
    """One decoder layer: the function compiled per token bucket, shared by every layer."""
    return layer(x, residual, md, kv_cache, cos_sin)


def _head(model, x, residual):
    """Final norm and LM head for the sample rows: their fp32 logits (compiled per row bucket)."""
    hidden, _ = model.ops.fused_add_rms_norm(x, residual, model.model.norm.weight,
                                             model.config.rms_norm_eps)
    return model.compute_logits(hidden).float()


def _sample(sampler: Sampler, plan: SamplerPlan, logits, sampling, history, prompt_lens, total_lens,
            suppress_ids, masks=None):
    """The sampler over the rows' logits: compiled per row bucket and plan (the warm plans have
    no constrained row); eager for other plans and for a constrained batch with its token masks
    (``masks``, :class:`blink.engine.token_mask.MaskBatch`)."""
    return sampler(logits, sampling, history, prompt_lens, total_lens, total_lens,
                   suppress_ids, plan=plan, masks=masks)


#: inductor options of the compiled sampler. Its C++ code generation inlined the Gumbel draw's
#: per-row hash (four Murmur finalisers, ~60 ops) into the [rows, vocab] kernel and generated its
#: loop body again and again: 23-30 s a random-plan graph on a Xeon (1-4 rows). Chains of more
#: than 30 ops realised as their own buffers: 4-13 s, the same tokens and logprobs (4,200 draws
#: at 1-64 rows, docs/performance.md#compiled-sampler). The head keeps the defaults: with this
#: option over the whole head (norm, LM head and sampler in one graph) tokens differed from eager.
SAMPLER_COMPILE_OPTIONS = {"realize_opcount_threshold": 30}


class CompiledModelPhase:
    """The CPU loop's forward → sample → update with compiled pieces (see the module doc).

    Built by the engine on its loop thread (inductor's CPU kernels are generated for the
    thread count at compile time), which then calls :meth:`warm` before it reports READY.
    """

    def __init__(self, executor, sampler: Sampler, *, scheduler_buckets: tuple[int, ...],
                 max_rows: int, suppress_width: int, max_logit_bias: int,
                 progress: Progress = stderr_progress) -> None:
        from blink.kernels.cpu import paged_attention as cpu_paged_attention
        from blink.kernels.ops import compiled_cpu_ops

        if getattr(executor, "packed_weights", False):
            raise ValueError("a compiled step traces plain weights: build the executor with "
                             "pack_weights=False")
        self.executor = executor
        self.model = executor.model
        self.sampler = sampler
        self.progress = progress
        self.token_buckets = token_buckets(scheduler_buckets)
        self.row_buckets = row_buckets(max_rows)
        self.model.use_ops(compiled_cpu_ops())
        self.layer = compile_fn(_decoder_layer, "the decoder layer")
        self.head = compile_fn(_head, "the LM head")
        self.sample = compile_fn(_sample, "the sampler", options=SAMPLER_COMPILE_OPTIONS)
        from blink.kernels.reference import layers as reference

        self.attention_kernel = compile_fn(
            cpu_paged_attention.tile_attention, "the paged attention kernel",
            fallback=_refuse_eager_tiles, **cpu_paged_attention.compile_options(),
        )

        def attend(q, k_cache, v_cache, md, scale):
            if self.attention_kernel.failed is not None:
                return reference.paged_attention(q, k_cache, v_cache, md, scale)
            return cpu_paged_attention.paged_attention(q, k_cache, v_cache, md, scale,
                                                       self.attention_kernel)

        self.attend = attend

        def attend_eager(q, k_cache, v_cache, md, scale):
            # Eager code calls the kernel with another dispatcher state than the compiled layer
            # does, which no compiled entry has (refused, it stopped the engine loop): the
            # same tile code, uncompiled.
            return cpu_paged_attention.paged_attention(q, k_cache, v_cache, md, scale,
                                                       cpu_paged_attention.tile_attention)

        self.attend_eager = attend_eager
        self.suppress_width = suppress_width  # StepBatch.suppress_ids' width
        self.max_logit_bias = max_logit_bias  # the ring's, the width of the bias fields
        self.warm_plans: set[tuple[int, SamplerPlan]] = set()
        self.warm_seconds = 0.0

    # ---------------------------------------------------------------------------- start

    def warm(self) -> None:
        """Compile every bucket now, with a progress line each: the paged attention kernel,
        the decoder layer per token bucket, the head per row bucket and plan."""
        start = time.monotonic()

        ex = self.executor
        cfg = ex.config
        n = len(self.token_buckets)
        for i, tokens in enumerate(self.token_buckets, 1):
            # The first bucket also compiles the attention kernel (inside the attention op).
            self.progress(f"compiling bucket {i}/{n} ({tokens} tokens)…"
                          + (" (and the paged attention kernel)" if i == 1 else "")
                          + f" [{time.monotonic() - start:.0f} s]")
            md = _scratch_metadata(ex, tokens)
            x = torch.zeros(tokens, cfg.hidden_size, dtype=ex.dtype)
            args = (self.model.model.layers[0], x, torch.zeros_like(x),
                    _layer_metadata(md.slot_mapping, md.positions), ex.kv_caches[0], self.model.cos_sin)
            with self._onednn(tokens), self._attention_step(md, tokens):
                if not self.layer.warm(*args):
                    break
                # Once more as in steady state: the attention kernel, called from inside the
                # op, sees other dispatcher state on the compiled graph's first run (dynamo
                # guards it), so its steady-state entry is compiled here too.
                with warming():
                    self.layer(*args)
        n = len(self.row_buckets)
        for i, rows in enumerate(self.row_buckets, 1):
            self.progress(f"compiling the LM head and the sampler {i}/{n} ({rows} rows)… "
                          f"[{time.monotonic() - start:.0f} s]")
            x, residual, *sampler_args = _dummy_head_args(ex, rows, self.suppress_width, self.max_logit_bias)
            with self._onednn(rows):  # as in run(): both calls inside it
                if not self.head.warm(self.model, x, residual):
                    break
                logits = self.head(self.model, x, residual)
                for plan in WARM_PLANS:
                    if not self.sample.warm(self.sampler, plan, logits, *sampler_args):
                        break
                    self.warm_plans.add((rows, plan))
        self.warm_seconds = time.monotonic() - start
        self.progress(f"compiled in {self.warm_seconds:.1f} s (cache: {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})")

    # ----------------------------------------------------------------------------- step

    def _onednn(self, tokens: int):
        from blink.executor import _onednn_disabled

        single = tokens == 1 and self.executor._bf16_cpu
        return _onednn_disabled() if single else contextlib.nullcontext()

    def attention_step(self, batch, tokens: int):
        """The context an eager forward over ``batch``'s ``tokens`` tokens needs on this
        model (its attention is the compiled step's op, which reads the step's metadata; here
        with the tile code uncompiled): the CPU loop's eager steps under --compile (prompt
        logprobs)."""
        from blink.engine.step import compact_rows
        from blink.kernels.cpu.step_ops import attention_step

        return attention_step(compact_rows(batch, tokens), tokens, self.attend_eager)

    def _attention_step(self, md, num_tokens: int):
        from blink.kernels.cpu.step_ops import attention_step

        return attention_step(md, num_tokens, self.attend)

    def run(self, parts, batch, *, tokens: int, rows: int) -> None:
        """Forward → sample → update for ``batch`` with ``tokens`` real tokens and ``rows``
        sample rows, padded to their buckets (the same tokens as ``step.model_phase``)."""
        scheduler = parts.scheduler
        R = bucket_for(rows, self.row_buckets)
        model = self.model
        x, residual = self.forward(batch, tokens)
        index = batch.logits_indices[:R]
        inputs = scheduler.sampler_inputs(batch, R)  # padding rows: row 0's values, ignored
        plan = SamplerPlan.from_features(inputs.features[:rows], inputs.suppress_ids[:rows])
        history = (scheduler.token_history(batch, R)
                   if plan.any_penalty or plan.any_bad_words else None)
        rows_x, rows_residual = x.index_select(0, index), residual.index_select(0, index)
        sampler_args = (inputs.sampling, history, inputs.prompt_lens, inputs.total_lens, inputs.suppress_ids)
        with self._onednn(R):
            if (R, plan) in self.warm_plans:
                logits = self.head(model, rows_x, rows_residual)
                out = self.sample(self.sampler, plan, logits, *sampler_args)
            else:  # eager: a plan that is not warm, or constrained rows with their token masks
                # host_rows: only the constrained rows' logits are masked
                masks = scheduler.token_masks(batch, R, host_rows=True) \
                    if plan.any_constrained else None
                logits = _head(model, rows_x, rows_residual)
                out = _sample(self.sampler, plan, logits, *sampler_args, masks=masks)
        scheduler.update(batch, out.tokens, out.logprob, out.top_ids, out.top_logprobs,
                         num_tokens=tokens)

    def forward(self, batch, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled decoder layers over ``batch``'s ``tokens`` real tokens, padded to their
        bucket: the last layer's (hidden, residual) [bucket, hidden]."""
        from blink.engine.step import compact_rows

        T = bucket_for(tokens, self.token_buckets)
        model, ex = self.model, self.executor
        md = _layer_metadata(batch.attn.slot_mapping[:T], batch.attn.positions[:T])
        x = torch.nn.functional.embedding(batch.input_ids[:T], model.model.embed_tokens.weight)
        residual = torch.zeros_like(x)  # x + 0 == x: layer 0 runs the same graph as the rest
        on_layer = model.on_layer
        with self._onednn(T), self._attention_step(compact_rows(batch, tokens), tokens):
            for layer, kv_cache in zip(model.model.layers, ex.kv_caches):
                x, residual = self.layer(layer, x, residual, md, kv_cache, model.cos_sin)
                if on_layer is not None:
                    on_layer()
        return x, residual

    def logits(self, batch, tokens: int, index: torch.Tensor) -> torch.Tensor:
        """fp32 logits at the flat positions ``index``: the compiled layers, then the final
        norm and LM head eager (a speculative verify step: its lanes are no row bucket)."""
        model = self.model
        x, residual = self.forward(batch, tokens)
        hidden, _ = model.ops.fused_add_rms_norm(x.index_select(0, index), residual.index_select(0, index),
                                                 model.model.norm.weight, model.config.rms_norm_eps)
        return model.compute_logits(hidden).float()

    @property
    def refused(self) -> int:
        """Steady-state calls that would have recompiled (ran eager instead); 0 when healthy."""
        return self.layer.refused + self.head.refused + self.sample.refused + self.attention_kernel.refused


def _refuse_eager_tiles(*args: Any) -> torch.Tensor:
    raise RuntimeError("the paged attention kernel cannot run eager")  # see attend()


def _scratch_metadata(ex, tokens: int):
    """A ``tokens``-token step whose tokens all write to the scratch block (warm-up)."""
    from blink.kernels.attention_metadata import AttentionMetadata

    slot = ex.scratch_block * ex.block_size
    return AttentionMetadata(
        slot_mapping=torch.full((tokens,), slot, dtype=torch.long),
        positions=torch.zeros(tokens, dtype=torch.long),
        token_seq_idx=torch.zeros(tokens, dtype=torch.long),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.full((1, 1), ex.scratch_block, dtype=torch.int32),
        max_context=1,
        max_query_len=tokens,
    )


_NO_ROWS = torch.zeros(0, dtype=torch.int32)
_NO_TABLES = torch.zeros(0, 0, dtype=torch.int32)


def _layer_metadata(slot_mapping: torch.Tensor, positions: torch.Tensor):
    """What the compiled layer sees of the step: its tokens' cache slots and positions
    ([T] each, the bucket's shape). The row fields are empty placeholders: the attention op
    reads the step's real (compacted) metadata from its context, so no shape here depends
    on how many rows run or how long their contexts are."""
    from blink.kernels.attention_metadata import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=slot_mapping, positions=positions, token_seq_idx=positions,
        query_start_loc=_NO_ROWS, seq_lens=_NO_ROWS, block_tables=_NO_TABLES,
    )


def _dummy_head_args(ex, rows: int, suppress_width: int, max_logit_bias: int):
    """Head inputs shaped like a real step's (``CompiledModelPhase.run``) for ``rows`` rows."""
    x = torch.zeros(rows, ex.config.hidden_size, dtype=ex.dtype)
    st = SamplingTensors.empty(rows, max_logit_bias=max_logit_bias)
    st.seed.fill_(1)
    lens = torch.ones(rows, dtype=torch.long)
    return (x, torch.zeros_like(x), st, None, lens, lens + 1,
            torch.full((rows, suppress_width), -1, dtype=torch.int32))
