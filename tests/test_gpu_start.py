"""Starting a GPU loop fails cleanly, never leaving the process poisoned (checked on CPU).

- A failure inside a capture ends the capture before the error propagates, names what was
  being captured, and the engine leaves no ring segment behind.
- Tier B names each reason it cannot start: the cudaMallocAsync allocator backend,
  cuda-bindings older than 13; a GPU that refuses to register the shared-memory ring makes
  ``blink serve``'s engine refuse and ``LLM``'s engine fall back to an in-process ring.
- The in-process ring (that fallback's transport) serves the same tokens as loopback.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_engine import BASE, random_prompts, tiny_model_dir  # noqa: E402

from blink.engine import factory  # noqa: E402
from blink.engine.gpu import checks, host_sim, tier_b  # noqa: E402
from blink.engine.gpu.base import GpuEngine  # noqa: E402
from blink import llm as llm_module  # noqa: E402
from blink.engine.engine import EngineConfig  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402
from blink.errors import BlinkError  # noqa: E402
from blink.transport import InProcessRegion, InProcessTransport, TransportError, create_region  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SMALL = dict(BASE, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("gpu_start_models"))


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("blink")} if os.path.isdir("/dev/shm") else set()


def test_a_failing_capture_is_ended_and_named(model_dir, monkeypatch):
    apis: list[host_sim.EagerGraphApi] = []
    orig_init = host_sim.EagerGraphApi.__init__

    def init(self):
        orig_init(self)
        apis.append(self)

    def broken_model_phase(parts, batch, *, tokens, rows):
        raise RuntimeError("operation not permitted when stream is capturing")

    # The engine's own segments, by name: a diff of /dev/shm would also see segments that other
    # tests' engines in this worker create or remove meanwhile (a CI run failed on one).
    regions: list = []
    orig_create_region = GpuEngine._create_region

    def create_region(self, total_bytes):
        region = orig_create_region(self, total_bytes)
        regions.append(region)
        return region

    monkeypatch.setattr(host_sim.EagerGraphApi, "__init__", init)
    monkeypatch.setattr(tier_b, "graph_model_phase", broken_model_phase)
    monkeypatch.setattr(GpuEngine, "_create_region", create_region)
    cfg = EngineConfig(model=str(model_dir), device="cpu", **SMALL)
    with pytest.raises(BlinkError, match=r"capturing bucket \d+ into tier B's graph failed: RuntimeError"):
        factory.create_engine(cfg, "device", simulation=host_sim.HostSimulation())
    api = apis[-1]
    assert api.aborted_captures == 1 and api._capture is None  # the capture was ended
    names = {region.name for region in regions}
    assert len(names) == 1 and names.isdisjoint(_segments())  # the failed engine's ring is gone


def _tier_b_with(monkeypatch, *, backend: str, bindings: str | None) -> list[str]:
    """tier_b_problems with the GPU facts stubbed (no GPU here)."""
    monkeypatch.setattr(checks, "tier_a_problems", lambda device=None: [])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend)
    monkeypatch.setattr(checks, "_installed_version", lambda dist: bindings if dist == "cuda-bindings" else None)

    def no_driver():
        raise ImportError("stubbed")

    if bindings is None:
        monkeypatch.setattr(checks, "cuda_bindings_driver", no_driver)
    else:  # an importable module whose driver queries are not reached (the version refuses)
        monkeypatch.setattr(checks, "cuda_bindings_driver", lambda: object())
    return checks.tier_b_problems(torch.device("cuda", 0))


def test_tier_b_refuses_the_cuda_malloc_async_backend(monkeypatch):
    problems = _tier_b_with(monkeypatch, backend="cudaMallocAsync", bindings=None)
    assert any("cudaMallocAsync" in p for p in problems), problems


def test_tier_b_refuses_cuda_bindings_older_than_13(monkeypatch):
    problems = _tier_b_with(monkeypatch, backend="native", bindings="12.6.2")
    assert any("cuda-bindings 12.6.2 is too old" in p for p in problems), problems
    assert not any("cudaMallocAsync" in p for p in problems)


def _start_decision(monkeypatch, refused: str | None, in_process: bool):
    """create_engine's choice on a GPU whose ring registration is ``refused`` (stubbed)."""
    made = []
    monkeypatch.setattr(EngineConfig, "resolved_device", lambda self: torch.device("cuda", 0))
    monkeypatch.setattr(factory, "tier_a_problems", lambda device=None: [])
    monkeypatch.setattr(factory, "tier_b_problems", lambda device=None: [])
    monkeypatch.setattr(factory, "ring_registration_problem", lambda device: refused)
    monkeypatch.setattr(factory, "TierAEngine", lambda cfg, **kw: made.append((cfg, "A")) or "engine")
    monkeypatch.setattr(factory, "TierBEngine", lambda cfg, **kw: made.append((cfg, "B")) or "engine")
    factory.create_engine(EngineConfig(model="m", device="cuda"), "device", in_process_frontend=in_process)
    return made


def test_refused_ring_registration_falls_back_in_process_for_llm(monkeypatch, caplog):
    made = _start_decision(monkeypatch, "cudaHostRegister failed: operation not supported", True)
    assert made[0][0].transport == "inprocess" and made[0][1] == "B"
    assert "pinned memory of the engine's own" in caplog.text


def test_refused_ring_registration_stops_a_separate_frontend(monkeypatch):
    with pytest.raises(BlinkError, match="cannot map the shared-memory ring here.*operation not supported"):
        _start_decision(monkeypatch, "cudaHostRegister failed: operation not supported", False)


def test_registrable_ring_stays_shared_memory(monkeypatch):
    made = _start_decision(monkeypatch, None, False)
    assert made[0][0].transport == "loopback"


def test_in_process_transport_reads_and_writes_the_region():
    region = create_region("inprocess", 64)
    assert isinstance(region, InProcessRegion)
    t = InProcessTransport(region)
    t.write(8, b"\x01\x02\x03")
    t.fence()
    assert t.read(8, 3).tolist() == [1, 2, 3]
    assert bytes(region.buffer[8:11]) == b"\x01\x02\x03"  # the engine sees the same memory
    with pytest.raises(TransportError, match="outside"):
        t.write(63, b"\x00\x00")
    with pytest.raises(TransportError, match="no bootstrap"):
        region.session_offer({})


@pytest.mark.parametrize("loop", ["cpu", "device"])
def test_llm_over_the_in_process_ring_gives_the_loopback_tokens(model_dir, monkeypatch, loop):
    prompts = random_prompts(4, 5, 30, seed=2)

    def run(transport: str) -> list[list[int]]:
        with llm_module.LLM(str(model_dir), transport=transport, **SMALL) as llm:
            assert llm.engine.region.kind == transport
            return [o.token_ids for o in llm.generate(prompts, GREEDY, timeout_s=120)]

    if loop == "device":
        real = factory.create_engine
        monkeypatch.setattr(llm_module, "create_engine",
                            lambda cfg, _loop="auto", **kw: real(cfg, "device", simulation=host_sim.HostSimulation()))
    assert run("inprocess") == run("loopback")
