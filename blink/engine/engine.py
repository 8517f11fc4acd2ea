"""The engine: model executor + scheduler + sampler over a ring, driven by the CPU loop.

The CPU loop is an engine thread (``blink-loop``) that repeats ``schedule → forward → sample
→ update`` over CPU tensors, one step per call of its step runner (:mod:`blink.engine.runners`:
eager, CPU graphs or compiled; the GPU tiers subclass the engine with runners of their own). Everything a request needs comes
from the ring and everything the engine produces goes back into it: the offline
:class:`~blink.llm.LLM` and the HTTP frontend are both just ring clients.
"""
from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from blink.model_config import ModelConfig
from blink.dtypes import cpu_has_native_bf16, resolve_dtype
from blink.engine.compiled import enforce_eager_default
from blink.engine.kv_transfer import KVLayout, KVSender, share_kv_cache
from blink.engine.runners import (
    PROMPT_LOGPROB_RUNNERS,
    CompiledRunner,
    CpuGraphsRunner,
    EagerRunner,
    SpecCpuGraphsRunner,
    SpecRunner,
    StepRunner,
    choose_step_runner,
)
from blink.engine.step import StepParts
from blink.engine.sampler import Sampler
from blink.engine.sched.scheduler import Scheduler
from blink.engine.draft_model import DraftModel, check_draft_runner, draft_kv_bytes_per_token, open_draft
from blink.engine.speculative import SpecScheduler
from blink.engine.sched.state import SchedulerConfig, ring_tensors
from blink.engine.token_mask import DEFAULT_MASK_TIMEOUT_S
from blink.engine_options import DISAGG_ROLES, config_default
from blink.errors import BlinkError
from blink.shared.speculative_config import SpeculativeConfigError, parse_speculative_config
from blink.kernels.cpu.threads import set_kernel_threads
from blink.executor import ModelExecutor
from blink.ring import (
    mask_words_for,
    C_ENGINE_STATE,
    C_HEARTBEAT,
    C_SHUTDOWN,
    ENGINE_DRAINING,
    ENGINE_FAILED,
    ENGINE_READY,
    ENGINE_STOPPED,
    SLOT_RUNNING,
    SLOT_WRITTEN,
    Ring,
    RingConfig,
    RingLayout,
)
from blink.threads.roles import name_new_threads, set_thread_name, task_ids
from blink.threads.runtime import current_runtime
from blink.threads.telemetry import StepWaitMeter
from blink.transport import Region, create_region
from blink.transport.doorbell import Doorbell

log = logging.getLogger("blink.engine")

#: engines whose loop thread is running, stopped at interpreter exit (see _stop_running_engines)
_running_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _stop_running_engines() -> None:
    """Stop every running loop before the interpreter finalizes. A daemon loop thread still
    running then is killed when it next takes the GIL, and the forced unwind through torch's
    C++ frames aborts the process ("terminate called without an active exception", exit 134):
    a script that makes an ``LLM`` and exits without ``close()`` would crash at its end."""
    for engine in list(_running_engines):
        engine.stop(drain=False)

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class EngineConfig:
    """Everything that sizes the engine. Defaults suit CPU serving of a small model.

    A field a flag sets takes its default from the flag's one declaration
    (:func:`blink.engine_options.config_default`; the flag's help says what it means); the
    rest have no flag. The ring's and the scheduler's configs are derived from it
    (:meth:`ring_config`, :meth:`scheduler_config`)."""

    model: str = config_default("model")
    dtype: str = config_default("dtype")  # auto | float32 | bfloat16 (auto: see blink.dtypes)
    device: str = config_default("device")  # auto | cpu | cuda
    max_model_len: int | None = config_default("max_model_len")
    block_size: int = config_default("block_size")
    kv_cache_tokens: int | None = config_default("kv_cache_tokens")
    kv_cache_memory_gib: float = config_default("kv_cache_memory_gib")
    max_num_seqs: int = config_default("max_num_seqs")
    #: the step's token budget (vLLM's default; docs/performance.md#token-budget)
    max_num_batched_tokens: int = config_default("max_num_batched_tokens")
    max_admit_per_step: int = 16
    #: fcfs | priority (vLLM's --scheduling-policy; SchedulerConfig.scheduling_policy)
    scheduling_policy: str = config_default("scheduling_policy")
    enable_prefix_caching: bool = config_default("enable_prefix_caching")
    stream_capacity: int = 64
    #: structured outputs: the ring gets a token-mask row per slot (off: constrained
    #: requests are refused with 400)
    structured_outputs: bool = config_default("structured_outputs")
    #: how long a constrained row waits at the sampling gate for its token mask
    #: (blink.engine.token_mask) before the request fails with an error
    mask_timeout_s: float = config_default("mask_timeout_s")
    #: most logprobs a request may ask for (vLLM's --max-logprobs): the ring's logprob columns
    max_logprobs: int = config_default("max_logprobs")
    #: ring lanes for prompt logprobs (--prompt-logprobs-lanes; 0: refused). The engine
    #: gives the ring none where its step cannot compute them (:meth:`Engine._prompt_logprob_lanes`)
    prompt_logprob_lanes: int = config_default("prompt_logprob_lanes")
    #: loopback | verbs | inprocess (a frontend in this process: LLM)
    transport: str = config_default("transport")
    threads: int | None = config_default("threads")
    #: CPU loop: threads the CPU kernels may split one call over (the projections, attention,
    #: norms and SiLU of prefills and decode steps, parts claimed by whichever thread is free):
    #: blink.kernels.cpu.threads. None: ``threads``
    kernel_threads: int | None = config_default("kernel_threads")
    #: how long a stop with drain waits for requests in flight (every loop kind uses this one)
    drain_timeout_s: float = 30.0
    #: CPU loop: run eager instead of torch.compile'd steps (default: $BLINK_ENFORCE_EAGER,
    #: else True, i.e. eager unless --compile). See blink.engine.compiled.
    enforce_eager: bool = field(default_factory=enforce_eager_default)
    #: where compiled code is cached (None: $BLINK_COMPILE_CACHE_DIR, else ~/.cache/blink/inductor)
    compile_cache_dir: str | None = config_default("compile_cache_dir")
    #: CPU bf16, eager: steps of few tokens run a GGUF file's Q4_0/Q4_1 projections on its
    #: own 4-bit codes (blink.models.int4_linear); False: always the bf16 copy
    int4_decode: bool = config_default("int4_decode")
    #: CPU loop, eager: steps whose every row decodes one token replay graphs of their C kernel
    #: calls (blink.decode_graphs); False: every step runs the Python forward
    cpu_graphs: bool = config_default("cpu_graphs")
    #: disaggregation (docs/disaggregation.md): "both" (prefill and decode, the default),
    #: "prefill" (also sends a request's prompt KV to a decode engine) or "decode" (also
    #: reserves blocks for prompts whose KV a prefill engine writes into its KV region)
    role: str = config_default("role")
    #: prefill role: the decode engines' bootstrap addresses (HOST:PORT), indexed by kv_peer
    kv_peers: tuple[str, ...] = config_default("kv_peers")
    #: prefill role: the fabric file (ARK path selection for the KV transfers,
    #: blink.fabric.kv_paths) and which of its senders this engine is; None: ARK off
    fabric: str | None = config_default("fabric")
    fabric_sender: str | None = config_default("fabric_sender")
    #: speculative decoding, vLLM's JSON (blink.shared.speculative_config); None: off
    speculative_config: str | None = config_default("speculative_config")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise BlinkError("--device cuda was asked for, but torch sees no CUDA GPU (use --device cpu)")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device, checkpoint_dtype: str | None = None) -> torch.dtype:
        """The compute dtype; ``auto`` follows :func:`blink.dtypes.resolve_dtype` (bf16 on
        CUDA and on CPUs with native bf16 unless the checkpoint is float32, else float32)."""
        return getattr(torch, self.dtype_choice(device, checkpoint_dtype)[0])

    def dtype_choice(self, device: torch.device, checkpoint_dtype: str | None = None,
                     codes_kernel: str | None = None) -> tuple[str, str]:
        """``(dtype name, why)``: :meth:`resolved_dtype` with the reason, for the start log;
        ``codes_kernel``: the kernel that takes the checkpoint's quantized projections on their
        codes at every step (:func:`blink.dtypes.resolve_dtype`)."""
        return resolve_dtype(self.dtype, device.type, checkpoint_dtype, codes_kernel=codes_kernel)

    def max_kv_blocks(self, max_model_len: int) -> int:
        """The most KV blocks one prompt can have when this engine takes part in
        disaggregation (the width of the ring's kv block-id fields); 0 for ``role`` both."""
        return 0 if self.role == "both" else -(-max_model_len // self.block_size)

    def ring_config(self, *, max_model_len: int, vocab_size: int,
                    prompt_logprob_lanes: int = 0) -> RingConfig:
        """The ring's sizes for this engine; the model gives the resolved ``max_model_len``
        and the logits' width (``vocab_size``, for the token masks); the engine the lanes for
        prompt logprobs its step runner can fill (0: none)."""
        return RingConfig(
            n_slots=self.max_num_seqs,
            arena_tokens=max(4 * max_model_len, 1 << 18),
            stream_capacity=self.stream_capacity,
            max_logprobs=self.max_logprobs,
            max_model_len=max_model_len,
            mask_words=mask_words_for(vocab_size) if self.structured_outputs else 0,
            max_kv_blocks=self.max_kv_blocks(max_model_len),
            prompt_logprob_lanes=prompt_logprob_lanes,
        )

    def scheduler_config(self, *, num_blocks: int, max_model_len: int,
                         eos_token_ids: Sequence[int]) -> SchedulerConfig:
        """The scheduler's config for this engine; the model and the KV cache's size give
        ``num_blocks``, the resolved ``max_model_len`` and the EOS ids."""
        return SchedulerConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_admit_per_step=self.max_admit_per_step,
            # decode role: rows whose KV arrived have no prefix hash chain to extend
            enable_prefix_caching=self.enable_prefix_caching and self.role != "decode",
            eos_token_ids=list(eos_token_ids),
            mask_timeout_s=self.mask_timeout_s,
            scheduling_policy=self.scheduling_policy,
        )


def _codes_kernel(config: EngineConfig, device: torch.device, files: Any, runner: str) -> str | None:
    """The kernel that would multiply every product of this model on the file's codes at
    every step, what ``--dtype auto`` asks on a CPU without native bf16; None where that is
    not the question (--dtype given, not a CPU, native bf16), under ``--int4-decode off`` or
    a compiled step (plain weights), for a file with matrices the kernels do not take (an HF
    directory; F16, Q5_0, IQ* or expert tensors, which would run as bf16 products without
    native bf16: float32 stays, not measured otherwise), or where no kernel takes every step
    here."""
    uncoded = getattr(files, "uncoded_matrices", None)
    if (config.dtype != "auto" or device.type != "cpu" or not config.int4_decode or runner == "compiled"
            or uncoded is None or cpu_has_native_bf16()):
        return None
    left = uncoded()
    if left is None or left:
        return None
    from blink.models import int4_linear

    return int4_linear.codes_every_step_kernel()


def _kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element


class Engine:
    """Loads the model, creates the ring region and runs the CPU loop in a thread.

    ``start()`` returns once the loop runs (engine state READY). ``stop(drain=True)`` lets
    running requests finish (bounded by ``drain_timeout_s``) before the loop exits.
    The GPU loops subclass it (:mod:`blink.engine.gpu`); :func:`blink.engine.factory.create_engine`
    builds the right one.
    """

    supported_devices: tuple[str, ...] = ("cpu",)
    #: the loop thread's OS name (its role in blink.threads.roles; tier A and B have their own)
    loop_thread_name = "blink-loop"
    #: its --loop value (tier A: host, tier B: device)
    loop_flag = "cpu"
    #: whether the loop rings the frontend's doorbell after each step (:attr:`doorbell`): a
    #: host loop does; a device loop has no host step to ring it after
    rings_doorbell = True

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.resolved_device()
        if self.device.type not in self.supported_devices:
            raise BlinkError(
                "the CPU loop runs on --device cpu; on a GPU use --loop host or --loop device"
            )
        # The steps run on the loop thread, which gets the configured thread count. Everything
        # here runs on ONE thread: libgomp shortens its workers' spin-wait to almost nothing
        # once a process holds more OpenMP threads than cores, and a second team in this
        # (constructing) thread would make the loop's workers sleep and be woken between every
        # two ops. Measured on 2 cores, bf16 SmolLM2 decode: 36 -> 55 tok/s single stream,
        # 270 -> 326 tok/s at batch 16 (docs/performance.md#threads).
        for name in ("threads", "kernel_threads"):
            value = getattr(config, name)
            if value is not None and value < 1:
                raise BlinkError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        self.loop_threads = config.threads or torch.get_num_threads()
        threads_before = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(1)
        try:
            self._build(config)
        finally:
            torch.set_num_threads(threads_before)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._drain = True
        self.drain_timeout_s = config.drain_timeout_s
        self.error: BaseException | None = None
        #: prefill role: sends finished prompts' KV (attach_kv_peers); None otherwise
        self.kv_sender = None
        #: the attached frontend's doorbell, rung after every step of the loop (set by the
        #: bootstrap server while a frontend on this host holds the lease: blink.transport.doorbell)
        self.doorbell: Doorbell | None = None
        self.parts = StepParts(self.scheduler, self.executor, self.sampler)
        #: how this engine runs its step (``runner_choice``, decided in ``_build``)
        self.runner: StepRunner = self._make_runner()

    def _make_runner(self) -> StepRunner:
        """The CPU loop's step runner, as ``runner_choice`` says, and only it (its speculative
        variant included; its ``prepare`` runs on the loop thread before READY)."""
        name, speculative = self.runner_choice.name, self.runner_choice.speculative
        max_rows = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        if name == "compiled":
            return CompiledRunner(
                self.parts, cache_dir=self.config.compile_cache_dir,
                scheduler_buckets=self.scheduler_config.buckets, max_rows=max_rows,
                # StepBatch.suppress_ids: stop ids + EOS ids (the scheduler pads no EOS to one -1);
                # tests/test_compiled.py fails (a refused recompile) if this drifts from it.
                suppress_width=self.ring_config.max_stop_ids + max(1, len(self.scheduler_config.eos_token_ids)),
                max_logit_bias=self.ring_config.max_logit_bias,
            )
        if name == "cpu-graphs":
            return (SpecCpuGraphsRunner if speculative else CpuGraphsRunner)(self.parts, max_rows)
        return (SpecRunner if speculative else EagerRunner)(self.parts)

    def _build(self, config: EngineConfig) -> None:
        """Model, KV cache, ring, scheduler and sampler (``__init__``'s work)."""
        from blink.engine.null_model import NullExecutor, is_null_model, open_null_model
        from blink.loader import open_model

        if config.role not in DISAGG_ROLES:
            raise BlinkError(f"--role must be one of {', '.join(DISAGG_ROLES)}, got {config.role!r}")
        if config.role == "prefill" and not config.kv_peers:
            raise BlinkError("--role prefill needs --kv-peer HOST:PORT (a decode engine's "
                             "bootstrap address; repeat the flag for more)")
        if config.role != "prefill" and config.kv_peers:
            raise BlinkError("--kv-peer is for --role prefill")
        if config.role != "prefill" and (config.fabric or config.fabric_sender):
            raise BlinkError("--fabric / --fabric-sender are for --role prefill (the KV senders)")
        if config.fabric_sender and not config.fabric:
            raise BlinkError("--fabric-sender needs --fabric FILE")
        #: --speculative-config (blink.engine.speculative); None: off
        try:
            self.speculative = parse_speculative_config(config.speculative_config)
        except SpeculativeConfigError as e:
            raise BlinkError(str(e)) from None
        null = is_null_model(config.model)  # --model null: no model work (control-plane benchmark)
        choice = self.runner_choice = choose_step_runner(
            loop=self.loop_flag, device=self.device.type, enforce_eager=config.enforce_eager,
            cpu_graphs=config.cpu_graphs, has_model=not null,
            speculative=self.speculative is not None)
        draft_model = self.speculative is not None and self.speculative.method == "draft_model"
        if draft_model:
            check_draft_runner(choice.name, role=config.role, null_target=null)
        files = open_null_model() if null else open_model(config.model)
        draft_files = open_draft(self.speculative, files) if draft_model else None
        # said once the model is found, so a bad model name stays a one-line error
        log.info("step runner: %s (%s)", choice.name, choice.reason)
        model_config = ModelConfig.from_hf(files.hf_config, files.source)
        dtype_name, why = config.dtype_choice(self.device, model_config.hf_dtype,
                                              _codes_kernel(config, self.device, files, choice.name))
        dtype = getattr(torch, dtype_name)
        self.dtype, self.dtype_reason = dtype, why
        log.info("dtype %s (%s)", dtype_name, why)
        max_len = config.max_model_len or min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if config.kv_cache_tokens is not None:
            kv_tokens = config.kv_cache_tokens
        else:
            # a draft model's cache has as many blocks as the target's (blink.engine.draft_model)
            per_token = _kv_bytes_per_token(model_config, dtype) + (
                draft_kv_bytes_per_token(draft_files, dtype) if draft_files is not None else 0)
            kv_tokens = int(config.kv_cache_memory_gib * (1 << 30)) // per_token
        num_blocks = kv_tokens // config.block_size
        if num_blocks * config.block_size < max_len:
            raise BlinkError(
                f"the KV cache ({num_blocks * config.block_size} tokens) cannot hold one sequence "
                f"of max_model_len {max_len}: raise --kv-cache-memory/--kv-cache-tokens or lower "
                f"--max-model-len"
            )
        # A compiled step traces plain weights; only the cpu-graphs runner records graphs.
        packing = {} if null else {"pack_weights": choice.name != "compiled",
                                   "int4_decode": config.int4_decode,
                                   "cpu_graphs": choice.name == "cpu-graphs"}
        self.executor = (NullExecutor if null else ModelExecutor)(
            files, dtype=dtype, device=self.device, block_size=config.block_size,
            num_blocks=num_blocks, max_model_len=max_len, **packing,
        )
        matmul_backend = getattr(getattr(self.executor, "model", None), "matmul_backend", None)
        if matmul_backend is not None:  # chosen at load (blink.models.decoder); one line
            coded = getattr(self.executor, "int4_projections", (0, 0))[0] or getattr(self.executor, "q8_head", False)
            log.info("matmuls: %s%s", matmul_backend(), "; --int4-decode off: bf16 weights only" if coded else "")
        pages = getattr(self.executor, "pages", None)
        if pages is not None and self.device.type == "cpu":
            log.info("memory: %s", pages)
        self.model_config = model_config
        self.max_model_len = self.executor.max_model_len
        self.source = str(files.source)
        self.kv_region: Region | None = None
        self.kv_layout: KVLayout | None = None
        if config.role != "both":
            self.kv_layout = KVLayout.of_executor(self.executor, dtype)
        if config.role == "decode":
            # The KV cache lives in a transport region a prefill engine writes into.
            self.kv_region = create_region(config.transport, self.kv_layout.total_bytes)
            self._kv_view = share_kv_cache(self.executor, self.kv_layout, self.kv_region.buffer)

        self.ring_config = config.ring_config(max_model_len=self.max_model_len,
                                              vocab_size=model_config.vocab_size,
                                              prompt_logprob_lanes=self._prompt_logprob_lanes(null))
        self.region = self._create_region(RingLayout(self.ring_config).total_bytes)
        self.ring = Ring.create(self.region.buffer, self.ring_config)
        self.scheduler_config = config.scheduler_config(
            num_blocks=num_blocks, max_model_len=self.max_model_len,
            eos_token_ids=model_config.eos_token_ids)
        #: --speculative-config draft_model: the draft (blink.engine.draft_model); None otherwise
        self.drafter = (DraftModel(draft_files, self.executor, cpu_graphs=choice.name == "cpu-graphs")
                        if draft_files is not None else None)
        if self.speculative is not None:
            self.scheduler = SpecScheduler(self.scheduler_config, self._ring_tensors(), self.device,
                                           spec=self.speculative, drafter=self.drafter)
            log.info("speculative decoding: %s", self.speculative.to_json())
        else:
            self.scheduler = Scheduler(self.scheduler_config, self._ring_tensors(), self.device)
        self.sampler = Sampler(max_logprobs=max(self.ring_config.max_logprobs, 1))

    def _prompt_logprob_lanes(self, null_model: bool) -> int:
        """The ring's prompt-logprob lanes: --prompt-logprobs-lanes where this engine's step
        computes them (the CPU loop's eager, cpu-graphs and compiled runners, one engine doing
        prefill and decode, a real model, no speculative decoding: blink.engine.prompt_logprobs),
        else 0, which makes the frontend refuse ``prompt_logprobs`` by name."""
        lanes = self.config.prompt_logprob_lanes
        if lanes < 0:
            raise BlinkError(f"--prompt-logprobs-lanes must be at least 0, got {lanes}")
        capable = (self.runner_choice.name in PROMPT_LOGPROB_RUNNERS and not null_model
                   and not self.runner_choice.speculative and self.config.role == "both")
        return lanes if capable else 0

    def _create_region(self, total_bytes: int) -> Region:
        """The memory the ring lives in (``--transport``; ``inprocess`` for ``LLM`` only)."""
        return create_region(self.config.transport, total_bytes)

    def _ring_tensors(self) -> dict[str, torch.Tensor]:
        """The ring's fields as tensors the scheduler can use from ``self.device``."""
        return ring_tensors(self.ring)

    # ---------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=self.loop_thread_name, daemon=True)
        self._thread.start()
        _running_engines.add(self)
        while self.ring.engine_state not in (ENGINE_READY, ENGINE_FAILED):
            time.sleep(0.001)

    def stop(self, drain: bool = True) -> None:
        """Stop the loop; with ``drain`` let requests in flight finish first."""
        self._drain = drain
        self._stop.set()
        _running_engines.discard(self)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.stop(drain=False)
        if self.kv_sender is not None:
            self.kv_sender.close()
        self.region.close()
        if self.kv_region is not None:
            self._kv_view = None
            self.executor.kv_caches = []
            self.kv_region.close()

    def attach_kv_peers(self, secret: bytes | None) -> None:
        """Prefill role: the sender that writes finished prompts' KV into the decode engines
        (``kv_peers``), authenticating with ``secret``; they are reached on first use."""
        if self.config.role != "prefill":
            return
        self.kv_sender = KVSender(self.scheduler, self.executor, self.dtype, self.ring.control,
                                  self.config.kv_peers, secret)
        if self.config.fabric is None:
            log.info("ARK path selection off (no --fabric): KV transfers take the transport's "
                     "default path")
            return
        from blink.fabric.kv_paths import ArkPathSelector, FabricConfig

        self.kv_sender.path_selector = ArkPathSelector(
            FabricConfig.load(self.config.fabric), self.config.fabric_sender, self.config.kv_peers)

    def __enter__(self) -> "Engine":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ----------------------------------------------------------------------------- the loop

    def _bump_heartbeat_per_layer(self, on: bool) -> None:
        """CPU loop: also bump the heartbeat after every decoder layer (the scheduler bumps it
        once per step), so a long step (a big prefill on a loaded CPU) keeps showing progress
        and the frontend does not take a slow engine for a hung one. Progress only: no layer
        finishing, no bump."""
        model = getattr(self.executor, "model", None)
        if model is None or not hasattr(model, "on_layer") or self.device.type != "cpu":
            return  # the null model has no layers; GPU graphs run no Python per layer
        control = self.ring.control

        def bump() -> None:
            control[C_HEARTBEAT] += 1

        bump.progress_only = True  # a replayed decode graph calls it once per step (blink.decode_graphs)
        model.on_layer = bump if on else None
        if self.drafter is not None:  # a draft model's pass over a long prefill shows progress too
            self.drafter.executor.model.on_layer = model.on_layer

    def _start_openmp_team(self) -> None:
        """CPU loop: set this thread's OpenMP team size and create the team now (one parallel
        op), so its workers can be named ``blink-omp-N`` (and get their thread policy) before
        the first request instead of appearing unnamed as ``blink-loop`` at the first step."""
        before = task_ids()
        torch.set_num_threads(self.loop_threads)  # this thread's OpenMP team (see __init__)
        set_kernel_threads(self.config.kernel_threads or self.loop_threads)
        # replayed steps' torch ops on one thread, eager forwards on the team (ModelExecutor.eager_threads)
        for executor in (self.executor, self.drafter.executor if self.drafter is not None else None):
            if executor is not None and getattr(executor, "decode_graphs", None) is not None:
                executor.eager_threads = self.loop_threads
        if self.loop_threads > 1:
            torch.ones(1 << 20).add_(1)  # big enough for at::parallel_for to use the team
        name_new_threads(before, "blink-omp-", self.loop_thread_name)

    def _run(self) -> None:
        set_thread_name(self.loop_thread_name)
        if self.device.type == "cpu":
            self._start_openmp_team()
        # The loop thread's run-queue wait per step (blink:engine_step_runqueue_wait_seconds)
        step_wait = StepWaitMeter()
        runtime = current_runtime()
        if runtime is not None:
            runtime.step_wait = step_wait
        control = self.ring.control
        try:
            self._prepare_native_kernels()
            self.runner.prepare()
            if self.drafter is not None:  # a draft model's decode graphs, too
                self.drafter.prepare(min(self.config.max_num_seqs, self.config.max_num_batched_tokens))
        except BaseException as exc:
            self.error = exc
            control[C_ENGINE_STATE] = ENGINE_FAILED
            print("blink engine start failed:\n" + traceback.format_exc(), file=sys.stderr, flush=True)
            return
        self._bump_heartbeat_per_layer(True)
        control[C_ENGINE_STATE] = ENGINE_READY
        idle_sleep = 0.0
        progressed = False  # the last step ran something
        drain_deadline: float | None = None
        try:
            with torch.inference_mode():
                while True:
                    # The loop is the heartbeat's one writer (plus the per-layer bumps of a
                    # long CPU step, see _bump_heartbeat_per_layer).
                    control[C_HEARTBEAT] += 1
                    if self._stop.is_set() or control[C_SHUTDOWN]:
                        if not self._drain or self._idle():
                            break
                        if drain_deadline is None:
                            control[C_ENGINE_STATE] = ENGINE_DRAINING
                            drain_deadline = time.monotonic() + self.drain_timeout_s
                        elif time.monotonic() > drain_deadline:
                            log.warning("drain timed out with requests still in flight")
                            break
                    # (Not right after a step that ran: a step is the idle check's cost, and
                    # then only when the work just ended.)
                    if not progressed and self._idle():
                        # Nothing to do: back off (no busy spin).
                        idle_sleep = min(max(idle_sleep * 2, 5e-5), 5e-3)
                        time.sleep(idle_sleep)
                        continue
                    step_wait.begin()
                    progressed = self.step()
                    step_wait.end()
                    bell = self.doorbell
                    if bell is not None:  # tokens, finishes or admissions for the frontend to read
                        bell.ring()
                    if progressed:
                        idle_sleep = 0.0
                    else:
                        # Rows exist but none can run (full output streams): back off too.
                        idle_sleep = min(max(idle_sleep * 2, 5e-5), 2e-3)
                        time.sleep(idle_sleep)
            control[C_ENGINE_STATE] = ENGINE_STOPPED
        except BaseException as exc:  # the loop must never die silently
            self.error = exc
            control[C_ENGINE_STATE] = ENGINE_FAILED
            print("blink engine loop failed:\n" + traceback.format_exc(), file=sys.stderr, flush=True)
        finally:
            self._bump_heartbeat_per_layer(False)

    def _prepare_native_kernels(self) -> None:
        """CPU loop, before READY: build (or load from the cache) Blink's C kernels now, with
        a progress line, instead of in the first request's step; a library that cannot be
        built is said once and its fallback runs for the rest of this start
        (:func:`blink.shared.native_build.prepare_libraries`)."""
        if self.device.type != "cpu" or getattr(self.executor, "model", None) is None:
            return  # GPU tiers do not run them; the null model has no forward
        from blink.kernels.cpu import attention as cpu_attention
        from blink.shared.native_build import prepare_libraries

        prepare_libraries(log=log)
        # beside the matmuls' line: which attention kernel, and whether it may use AMX
        log.info("attention: %s", cpu_attention.describe())

    def _idle(self) -> bool:
        """Host-side check (CPU loop only) that no slot needs the engine: FREE slots and
        FINISHED slots waiting for the frontend to read them need no step."""
        state = self.ring.state
        if bool(((state == SLOT_WRITTEN) | (state == SLOT_RUNNING)).any()):
            return False
        return not self.scheduler.has_pending_release()  # finished rows' blocks still held

    def step(self) -> bool:
        """One engine step, its runner's. Returns False when nothing was scheduled."""
        sender = self.kv_sender  # prefill role: KV streamed during the forward, ready after
        ran = self.runner.run(sender.before_forward if sender is not None else None)
        if sender is not None:  # before the finished rows' blocks go
            sender.after_step()
        return ran
