"""The scheduler: the engine's control plane (admission, budget, KV blocks, prefix cache,
preemption, publishing over the ring), as branch-free tensor code over fixed shapes.

Read ``reference.py`` first (the policy as a short per-request Python scheduler), then
``scheduler.py`` (the tensor code's ``schedule``/``update``, a list of stages, one file
each). ``state.py`` holds the fixed-shape ``EngineState`` and ``SchedulerConfig``.
"""
