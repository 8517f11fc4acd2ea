"""The network fabric under disaggregated prefill/decode: where KV transfers go, and how to
keep them apart (ARK, issue 18 parts 4 and 5).

- :mod:`~blink.fabric.topology`: a two-tier leaf-spine fabric and the links a path crosses.
- :mod:`~blink.fabric.ecmp`: switch hash models (CRC32- and Murmur3-style over the RoCEv2
  5-tuple, seeded) and how a leaf maps a hash to one of its uplinks.
- :mod:`~blink.fabric.ark`: ARK path selection: pick a UDP source port whose predicted path
  avoids spines that concurrent transfers from the same leaf reserved; the reservation
  protocol (one-to-all claims, deterministic resolution of simultaneous claims, release).
- :mod:`~blink.fabric.bus`: the message bus the senders broadcast on (in-process, TCP on
  localhost).
- :mod:`~blink.fabric.roce`: putting the chosen source port on a RoCEv2 queue pair (flow
  label or mlx5dv), and saying clearly when that is not possible.
- :mod:`~blink.fabric.kv_paths`: ARK on the real KV transfers: the ``--fabric`` file and the
  prefill engine's path selector (one lease per transfer).
- :mod:`~blink.fabric.sim`: a flow-level (max-min fair) simulator comparing ECMP, ARK, a
  PLB-like re-path and an oracle under Poisson P/D traffic.

Pure Python (numpy in the simulator, pydantic for the fabric file): nothing here imports
torch.
"""
