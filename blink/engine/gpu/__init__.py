"""The GPU device loops: tier A (host-driven CUDA graphs) and tier B (CPU-free).

Both run the CPU loop's own step (:mod:`blink.engine.step`): ``scheduler.schedule()`` and
``model_phase`` (forward → sampler → ``scheduler.update``), captured into CUDA graphs, one
schedule graph and one graph per token bucket (``SchedulerConfig.buckets``).

- :mod:`~blink.engine.gpu.base`: what both tiers share (ring mapping, warm-up under the
  capture audit, release); :mod:`~blink.engine.gpu.tier_a` and
  :mod:`~blink.engine.gpu.tier_b`: one engine class per tier, with its CUDA graphs and its
  step runner (:mod:`blink.engine.runners`).
- :mod:`~blink.engine.gpu.plan`: which graphs, in which order, with which shapes.
- :mod:`~blink.engine.gpu.abi`: what the loop's CUDA C and the host share (the kernels are
  built by :mod:`blink.kernels.cuda.nvrtc_build`).
- :mod:`~blink.engine.gpu.mapped_ring`: the ring where the GPU can reach it.
- :mod:`~blink.engine.gpu.checks`: what keeps a tier from starting.
- :mod:`~blink.engine.gpu.host_sim`: the tiers on the host, for the CPU suite: tests and dry
  runs inject it (``create_engine(config, loop, simulation=HostSimulation())``); no product
  module imports it (``tests/test_import_graph.py``).

The engines are built by :func:`blink.engine.factory.create_engine`.
"""
