"""What both GPU tiers share: the ring mapped into the GPU, the graph plan, a warm-up under
the capture audit, and a release that never unmaps a ring the GPU may still touch.

Tier A (:mod:`blink.engine.gpu.tier_a`) and tier B (:mod:`blink.engine.gpu.tier_b`) are
subclasses; each owns its loop and its step runner. A :class:`HostSimulation` given by the
caller (tests and dry runs inject :class:`blink.engine.gpu.host_sim.HostSimulation`) runs a
tier's own code on CPU tensors, the graphs replaced by its eager stand-ins.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Protocol

import torch

from blink.engine.capture_audit import CaptureAudit
from blink.engine.engine import Engine, EngineConfig
from blink.engine.gpu.abi import LoopOptions
from blink.engine.gpu.mapped_ring import MappedRing, PinnedRegion, map_pinned_ring, map_ring
from blink.engine.gpu.plan import GraphPlan, plan_graphs
from blink.engine.runners import StepRunner
from blink.engine.step import graph_model_phase
from blink import env as blink_env
from blink.errors import BlinkError
from blink.ring import SLOT_FREE, RingLayout
from blink.transport import Region

log = logging.getLogger("blink.gpu")

#: engines whose loop was launched on the device and has not been seen to end (tier B):
#: while one is here, a device-wide synchronize (``torch.cuda.synchronize()``,
#: ``empty_cache()``) would wait for it forever.
_RUNNING_LOOPS: "weakref.WeakSet[GpuEngine]" = weakref.WeakSet()


def device_loop_running() -> bool:
    """Whether a device loop of this process may still be running on the GPU."""
    return any(e._device_may_touch_ring() for e in list(_RUNNING_LOOPS))


class HostSimulation(Protocol):
    """The GPU graphs' stand-ins on the host, for running a tier on CPU tensors."""

    def graph_runner(self) -> Any:
        """Tier A's :class:`~blink.engine.gpu.tier_a.GraphRunner`."""
        ...

    def graph_api(self) -> Any:
        """Tier B's :class:`~blink.engine.gpu.tier_b.GraphApi`."""
        ...


class GpuEngine(Engine):
    """An engine whose loop runs CUDA graphs (or, with a ``simulation``, their host stand-ins)."""

    supported_devices = ("cuda", "cpu")
    tier = "?"  # "A" | "B", set by the subclass
    loop_flag = "?"  # its --loop value, for messages
    #: the ring's device mapping, set by ``_ring_tensors`` while ``Engine.__init__`` builds
    mapped: MappedRing | None = None

    def __init__(self, config: EngineConfig, *, simulation: HostSimulation | None = None,
                 options: LoopOptions | None = None) -> None:
        #: the graphs' host stand-ins (tests, dry runs); None: CUDA graphs
        self.simulation = simulation
        self.simulate = simulation is not None
        self.options = options or LoopOptions()
        self.exit_reason: str | None = None
        try:
            super().__init__(config)  # ends with _make_runner: the tier's graphs
        except BaseException:
            if hasattr(self, "region"):
                self._release_ring()  # a failed start leaves no registered ring or segment behind
            raise

    def _make_runner(self) -> StepRunner:
        """The tier's runner, its graphs built (``Engine.__init__``'s last step)."""
        if self.device.type != "cuda" and not self.simulate:
            raise BlinkError(f"--loop {self.loop_flag} needs a CUDA GPU (--device cuda); use --loop cpu")
        if self.device.type == "cuda" and self.simulate:
            raise BlinkError("a host simulation runs on CPU tensors only")
        # Captured graphs run every scheduler stage (no host reads between kernels).
        self.scheduler.host_guards = False
        if blink_env.get("BLINK_FUSED_SCHEDULER", "") not in ("", "0"):
            # Issue 32's fused Triton stages: opt-in until a GPU run has measured them.
            self.scheduler.use_fused(True)
        self.plan: GraphPlan = plan_graphs(self.scheduler_config, self.ring_config.n_slots)
        t0 = time.monotonic()
        with torch.inference_mode():
            runner = self._build_graphs()
        log.info("tier %s graphs for buckets %s built in %.1f s", self.tier, self.plan.buckets,
                 time.monotonic() - t0)
        return runner

    def _build_graphs(self) -> StepRunner:
        raise NotImplementedError

    # -- construction hooks (called by Engine.__init__)
    def _create_region(self, total_bytes: int) -> Region:
        if self.device.type == "cuda" and self.config.transport == "inprocess":
            return PinnedRegion(total_bytes)
        return super()._create_region(total_bytes)

    def _ring_tensors(self) -> dict[str, torch.Tensor]:
        if self.device.type != "cuda":
            return super()._ring_tensors()
        layout = RingLayout(self.ring_config)
        if isinstance(self.region, PinnedRegion):
            self.mapped = map_pinned_ring(self.region, layout, self.device)
        else:
            self.mapped = map_ring(self.region.buffer, layout, self.device)
        return self.mapped.views

    def _warmup(self) -> None:
        """Run the step once per bucket, eagerly, on the empty ring (Triton JIT, cuBLAS),
        under the capture audit: on the GPU it also sees copies between host and device. What
        it flags is logged by name before the first capture, so a capture that then fails
        says why; the capture itself stays the judge (the audit could flag an op a graph
        happens to tolerate, and a first GPU run should not be refused on a guess)."""
        if not bool((self.ring.state == SLOT_FREE).all()):
            raise BlinkError("the GPU loop is built before any request is accepted")
        audit = CaptureAudit()
        with audit:
            batch = self.scheduler.schedule()
            for tokens, rows in zip(self.plan.buckets, self.plan.rows):
                graph_model_phase(self.parts, batch, tokens=tokens, rows=rows)
        if self.device.type == "cuda":  # stream-scoped: never a device-wide synchronize
            torch.cuda.current_stream(self.device).synchronize()
        self.audit_violations = audit.violations
        if audit.violations:
            log.error("%d op(s) in the step the GPU graphs capture look capture-unsafe:\n%s",
                      len(audit.violations), "\n".join(f"  {v}" for v in audit.violations[:40]))

    # -- lifecycle
    def close(self) -> None:
        self.stop(drain=False)
        self._release_ring()

    def _device_may_touch_ring(self) -> bool:
        """Whether a loop launched on the device may still read or write the ring."""
        return False

    def _release_ring(self) -> None:
        """Unregister the mapped ring, then unmap it; never unmap a ring the GPU may still
        touch: while a hung device loop runs (or unregistering fails) the mapping stays until
        the process exits, and only the segment's name is removed."""
        if self.mapped is not None and self.mapped.registered:
            if self._device_may_touch_ring():
                log.error("the device loop is still running at close; the ring stays registered "
                          "and mapped until the process exits")
                self.region.unlink()
                return
            self._synchronize_streams()
            if not self.mapped.unregister():
                self.region.unlink()
                return
        self.region.close()

    def _synchronize_streams(self) -> None:
        """Wait for this engine's own work (torch's current stream and the loop's streams),
        never device-wide: another engine's tier B loop may be running in the process, and a
        device-wide synchronize would wait for it forever."""
        torch.cuda.current_stream(self.device).synchronize()
        for owner in (self, getattr(self, "api", None)):
            for name in ("stream", "watch_stream"):
                stream = getattr(owner, name, None)
                if isinstance(stream, torch.cuda.Stream):
                    stream.synchronize()

    def loop_counters(self) -> dict[str, int]:
        """What the device loop counted (tier B); empty for a host-driven loop."""
        return {}
