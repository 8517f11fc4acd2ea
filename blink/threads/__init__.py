"""Blink's host threads: their role names, a scheduling policy applied to them, and their
telemetry. Torch-free (the frontend uses it too); one module per concern:

- :mod:`blink.threads.roles`: the role of every thread Blink starts and its OS name
- :mod:`blink.threads.syscalls`: the scheduling syscalls (affinity, nice, class, EEVDF slice,
  I/O priority), injectable for tests, and the capability probe
- :mod:`blink.threads.policy`: the ``--thread-policy`` YAML file, its validation, applying it
- :mod:`blink.threads.runtime`: the per-process watcher that applies the policy to threads
  created later and publishes the reports and telemetry
- :mod:`blink.threads.telemetry`: run-queue wait, context switches, CPU time per role
- :mod:`blink.threads.metrics`: the Prometheus series of the above (``/metrics``)
- :mod:`blink.threads.gthulhu`: the policy as Gthulhu scheduling-strategy objects

See ``docs/threads.md``.
"""
