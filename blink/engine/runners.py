"""How an engine runs its step: one :class:`StepRunner` per way, chosen once per engine.

Five ways run the same step (:mod:`blink.engine.step`: schedule → forward → sample →
update):

- ``eager``: the CPU loop's Python step (:func:`blink.engine.step.run_step`);
- ``cpu-graphs``: the eager step, whose decode steps replay recorded C kernel calls
  (:mod:`blink.decode_graphs`; recorded before READY);
- ``compiled``: ``--compile``, the model phase from ``torch.compile``'d pieces per bucket
  (:mod:`blink.engine.compiled`; compiled before READY);
- ``tier-a``: ``--loop host``, CUDA graphs the host replays
  (:class:`blink.engine.gpu.tier_a.HostGraphStep`);
- ``tier-b``: ``--loop device``, one graph launched once, no host step at all
  (:class:`blink.engine.gpu.tier_b.DeviceLoop`).

:func:`choose_step_runner` is the one place that decides, from the engine's config, its device
and its loop; the engine names the choice in one start-log line (``step runner: NAME
(why)``), builds the runner, calls :meth:`StepRunner.prepare` on its loop thread before
READY, and then only :meth:`StepRunner.run` per step.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from blink.engine.compiled import (
    CompiledModelPhase,
    compile_cache_dir,
    configure_compile_cache,
    usable_compile_cache,
)
from blink.engine.speculative import run_spec_step
from blink.engine.prompt_logprobs import prompt_logprob_jobs
from blink.engine.step import StepParts, eager_model_phase, run_step, schedule_on_host
from blink.errors import BlinkError

log = logging.getLogger("blink.engine")

#: ``on_scheduled(batch)``: host code between a step's schedule and its forward
OnScheduled = Callable[[Any], None]

RUNNER_NAMES = ("eager", "cpu-graphs", "compiled", "tier-a", "tier-b")
#: the runners whose steps compute prompt logprobs (blink.engine.prompt_logprobs: the CPU
#: loop's host-side planning; a compiled step with such a row runs eagerly)
PROMPT_LOGPROB_RUNNERS = ("eager", "cpu-graphs", "compiled")


class StepRunner(Protocol):
    """One way to run the engine's step."""

    #: one of :data:`RUNNER_NAMES`
    name: str

    def prepare(self) -> None:
        """Before READY, on the loop thread: compile, record or capture what steps replay."""
        ...

    def run(self, on_scheduled: OnScheduled | None = None) -> bool:
        """One step; False when nothing was scheduled. ``on_scheduled(batch)`` runs between
        the schedule and the forward (host loops only: the prefill role's KV sender)."""
        ...


@dataclass(frozen=True)
class RunnerChoice:
    """Which runner an engine uses, and why (the start log says both)."""

    name: str
    reason: str
    #: --speculative-config: the runner verifies drafts; ``eager`` and ``cpu-graphs`` in their
    #: speculative variants (:class:`SpecRunner`, :class:`SpecCpuGraphsRunner`), ``compiled``
    #: and the GPU tiers in their own step
    speculative: bool = False


def choose_step_runner(*, loop: str, device: str, enforce_eager: bool, cpu_graphs: bool,
                       has_model: bool = True, speculative: bool = False) -> RunnerChoice:
    """The one decision: ``loop`` is the engine's loop (``cpu``, ``host``, ``device``),
    ``device`` its device type, the flags its config's; ``has_model`` False for ``--model
    null`` (no forward to compile or record); ``speculative``: --speculative-config is set
    (every runner verifies drafts: blink.engine.speculative), which the choice carries
    (:attr:`RunnerChoice.speculative`: the engine builds the variant from the choice alone)."""
    choice = _choose(loop=loop, device=device, enforce_eager=enforce_eager, cpu_graphs=cpu_graphs,
                     has_model=has_model, speculative=speculative)
    return replace(choice, speculative=speculative)


def _choose(*, loop: str, device: str, enforce_eager: bool, cpu_graphs: bool, has_model: bool,
            speculative: bool) -> RunnerChoice:
    """:func:`choose_step_runner`'s runner and reason."""
    if speculative and loop == "cpu" and (not has_model or enforce_eager):
        if device != "cpu":
            raise ValueError(f"the CPU loop runs on a CPU device, not {device}")
        if has_model and cpu_graphs:
            return RunnerChoice("cpu-graphs", "--speculative-config, --cpu-graphs auto: the eager step "
                                              "with drafts verified in the same forward; decode and "
                                              "verify steps replay recorded C kernel calls")
        return RunnerChoice("eager", "--speculative-config: the eager step with n-gram drafts "
                                     "verified in the same forward")
    # --speculative-config on the other runners: their step verifies the drafts too (tier A/B:
    # the captured verify phase, blink.engine.speculative.spec_model_phase; --compile: the
    # compiled layers, the head and sampler of a verify step eager)
    if loop == "host":
        return RunnerChoice("tier-a", "--loop host: the host replays the step's CUDA graphs")
    if loop == "device":
        return RunnerChoice("tier-b", "--loop device: one CUDA graph launched once, no host step")
    if device != "cpu":
        raise ValueError(f"the CPU loop runs on a CPU device, not {device}")
    if not has_model:
        return RunnerChoice("eager", "--model null: no forward to compile or record")
    if not enforce_eager:
        return RunnerChoice("compiled", "--compile: torch.compile'd layer and head per bucket")
    if cpu_graphs:
        return RunnerChoice("cpu-graphs", "eager CPU loop, --cpu-graphs auto: decode steps replay "
                                          "recorded C kernel calls")
    return RunnerChoice("eager", "--cpu-graphs off: every step runs the Python forward")


class EagerRunner:
    """The CPU loop's eager step."""

    name = "eager"

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    def prepare(self) -> None:
        pass

    def run(self, on_scheduled: OnScheduled | None = None) -> bool:
        return run_step(self.parts, on_scheduled)


class CpuGraphsRunner(EagerRunner):
    """The eager step whose decode steps replay their CPU graphs (the executor's
    ``decode_graphs``, which :meth:`prepare` records for every row count up to ``max_rows``)."""

    name = "cpu-graphs"

    def __init__(self, parts: StepParts, max_rows: int) -> None:
        super().__init__(parts)
        self.max_rows = max_rows

    def prepare(self) -> None:
        """Record every bucket now, on the loop thread with its kernel threads, so that no
        step pays for a recording."""
        graphs = getattr(self.parts.executor, "decode_graphs", None)
        if graphs is None:
            return
        t0 = time.monotonic()
        with torch.inference_mode():
            recorded = graphs.record(self.max_rows)
        if recorded:
            log.info("%s steps of up to %d tokens run on %d CPU graphs (recorded in %.1f s, %.0f MB; "
                     "--cpu-graphs off: eager)",
                     "decode" if graphs.max_query_len == 1 else "decode and verify",
                     max(b for b, _ in graphs.graphs), recorded, time.monotonic() - t0,
                     graphs.kept_bytes / 2**20)


class SpecRunner(EagerRunner):
    """``--speculative-config``: the eager step with n-gram drafts verified in the same
    forward (:func:`blink.engine.speculative.run_spec_step`)."""

    def run(self, on_scheduled: OnScheduled | None = None) -> bool:
        return run_spec_step(self.parts, on_scheduled)


class SpecCpuGraphsRunner(CpuGraphsRunner):
    """``--speculative-config`` with CPU graphs: decode steps and verify steps (rows of up to
    K + 1 positions: the last token and the draft) replay the recorded C kernel calls, the
    same graphs per bucket of tokens (:meth:`blink.decode_graphs.DecodeGraphs.allow_rows_of`;
    the executor picks by the step's shape), then the host-side accept and publish."""

    def prepare(self) -> None:
        graphs = getattr(self.parts.executor, "decode_graphs", None)
        if graphs is not None:
            graphs.allow_rows_of(self.parts.scheduler.spec.num_speculative_tokens + 1)
        super().prepare()

    def run(self, on_scheduled: OnScheduled | None = None) -> bool:
        return run_spec_step(self.parts, on_scheduled)


class CompiledRunner:
    """``--compile``: the model phase from compiled pieces padded to their buckets
    (:class:`~blink.engine.compiled.CompiledModelPhase`). :meth:`prepare` compiles on the loop
    thread (inductor generates the CPU kernels for its thread count); compiler failures fall
    back to eager inside, and a compile cache that cannot take the code (said once) leaves
    :attr:`compiled` None: every step then runs eager."""

    name = "compiled"

    def __init__(self, parts: StepParts, *, cache_dir: str | None, scheduler_buckets: tuple[int, ...],
                 max_rows: int, suppress_width: int, max_logit_bias: int) -> None:
        self.parts = parts
        self.cache_dir = cache_dir
        self.options = dict(scheduler_buckets=scheduler_buckets, max_rows=max_rows,
                            suppress_width=suppress_width, max_logit_bias=max_logit_bias)
        #: the compiled forward/sample, once prepared (None: eager)
        self.compiled: CompiledModelPhase | None = None
        #: --speculative-config: steps that verify drafts run run_spec_step
        self.speculative = hasattr(parts.scheduler, "verify_phase")

    def prepare(self) -> None:
        cache = compile_cache_dir(self.cache_dir)
        if not usable_compile_cache(cache, log):  # a full or read-only disk: eager, said once
            return
        configure_compile_cache(cache)
        compiled = CompiledModelPhase(self.parts.executor, self.parts.sampler, **self.options)
        with torch.inference_mode():
            compiled.warm()
        self.compiled = compiled

    def run(self, on_scheduled: OnScheduled | None = None) -> bool:
        if self.compiled is None:
            if self.speculative:
                return run_spec_step(self.parts, on_scheduled)
            return run_step(self.parts, on_scheduled)
        if self.speculative:  # verify steps: compiled layers (compiled.logits), eager head and sampler
            compiled = self.compiled
            return run_spec_step(
                self.parts, on_scheduled, forward=compiled.logits,
                normal=lambda batch, tokens, rows: compiled.run(self.parts, batch, tokens=tokens, rows=rows))
        scheduled = schedule_on_host(self.parts, on_scheduled)
        if scheduled is None:
            return False
        batch, tokens, rows = scheduled
        if prompt_logprob_jobs(self.parts.scheduler, batch):
            # their hidden states: the eager forward, whose attention op (the compiled step's)
            # takes the step's metadata from the compiled phase
            with self.compiled.attention_step(batch, tokens):
                eager_model_phase(self.parts, batch, tokens, rows)
            return True
        self.compiled.run(self.parts, batch, tokens=tokens, rows=rows)  # pads to its buckets
        return True
