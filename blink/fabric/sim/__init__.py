"""The fabric simulation (issue 18 part 5): ECMP vs ARK vs PLB vs an oracle, flow level.

``python -m blink.fabric.sim --help`` prints the comparison table; see
:mod:`~blink.fabric.sim.flowsim` for the model and :mod:`~blink.fabric.sim.workload` for the
traffic.
"""
