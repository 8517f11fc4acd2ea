"""The one engine factory: ``blink serve``, ``blink engine`` and ``LLM`` all build here."""
from __future__ import annotations

import dataclasses
import logging

import torch

from blink.engine.engine import Engine, EngineConfig
from blink.engine.gpu.abi import LoopOptions
from blink.engine.gpu.base import HostSimulation
from blink.engine.gpu.checks import ring_registration_problem, tier_a_problems, tier_b_problems
from blink.engine.gpu.tier_a import TierAEngine
from blink.engine.gpu.tier_b import TierBEngine
from blink.errors import BlinkError

log = logging.getLogger("blink.engine")


def create_engine(config: EngineConfig, loop: str = "auto", *, simulation: HostSimulation | None = None,
                  options: LoopOptions | None = None, in_process_frontend: bool = False) -> Engine:
    """The engine for ``--loop cpu|host|device|auto`` (``blink serve``, ``blink engine`` and
    ``LLM`` all come here).

    ``auto``: the CPU loop on a CPU device; on a GPU tier B, or tier A (with a warning
    naming what tier B lacks). ``device`` refuses to start where tier B cannot run.
    On a GPU whose driver refuses to register the shared-memory ring (gVisor), a frontend
    in another process cannot reach the engine: with ``in_process_frontend`` (``LLM``) the
    ring moves to pinned memory of the engine's own (``transport="inprocess"``, logged);
    otherwise the engine refuses to start, saying so.
    ``simulation`` (tests, dry runs: :class:`blink.engine.gpu.host_sim.HostSimulation`): the
    GPU loops' code on CPU tensors, the graphs replaced by its host stand-ins."""
    simulate = simulation is not None
    if loop not in ("auto", "cpu", "host", "device"):
        raise BlinkError(f"unknown --loop {loop!r}")
    if loop == "cpu" and config.device == "auto":
        config = dataclasses.replace(config, device="cpu")
    device = torch.device("cpu") if simulate else config.resolved_device()
    if loop == "cpu" or (loop == "auto" and device.type == "cpu" and not simulate):
        return Engine(config)
    if config.role != "both":  # the KV sender runs between steps: host code of the CPU loop
        raise BlinkError(f"--role {config.role} runs on the CPU loop only in this release "
                         f"(--loop cpu); the GPU tiers serve --role both")
    if device.type != "cuda" and not simulate:
        raise BlinkError(f"--loop {loop} runs CUDA graphs and needs a CUDA GPU (--device cuda); "
                         f"torch sees none here: use --loop cpu")
    if simulate:
        config = dataclasses.replace(config, device="cpu")
        tier = TierAEngine if loop == "host" else TierBEngine
        return tier(config, simulation=simulation, options=options)
    tier_a = tier_a_problems(device)
    if tier_a:
        raise BlinkError(f"--loop {loop} cannot start: " + "; ".join(tier_a))
    if config.transport == "loopback":
        refused = ring_registration_problem(device)
        if refused is not None and in_process_frontend:
            log.warning("the GPU cannot map a shared-memory ring (%s): the ring is pinned memory "
                        "of the engine's own, read by this process's frontend (transport inprocess)",
                        refused)
            config = dataclasses.replace(config, transport="inprocess")
        elif refused is not None:
            raise BlinkError(
                f"--loop {loop}: the GPU cannot map the shared-memory ring here ({refused}), so a "
                "frontend in another process cannot reach the engine's memory. Run the frontend in "
                "the engine's process (blink.LLM falls back to a pinned in-process ring by itself) "
                "or serve from the CPU with --loop cpu --device cpu.")
    if loop == "host":
        return TierAEngine(config, options=options)
    problems = tier_b_problems(device)
    if problems:
        if loop == "device":
            raise BlinkError("--loop device (tier B, CPU-free) cannot start here: " + "; ".join(problems)
                             + ". Use --loop host (tier A) or --loop auto (falls back to tier A).")
        log.warning("tier B unavailable (%s); using tier A (host-driven CUDA graphs)", "; ".join(problems))
        return TierAEngine(config, options=options)
    return TierBEngine(config, options=options)
