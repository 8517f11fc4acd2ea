"""P/D traffic for the fabric simulator: KV sizes from real model shapes, Poisson arrivals.

A KV transfer moves the prompt's whole KV cache from a prefill host to a decode host:
``2 (K and V) * layers * kv_heads * head_dim * dtype_bytes * tokens`` bytes. The shapes are
the ones ``configs/*.yaml`` document for Blink's presets (``tests/test_fabric_sim.py`` checks
this table against those files, so the two cannot drift).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blink.fabric.topology import LeafSpine


@dataclass(frozen=True)
class KVShape:
    """What one token's KV cache is made of."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bfloat16
    prefill_tokens_per_s: float = 20_000.0  # assumed prefill throughput of one engine (for TTFT)

    def kv_bytes(self, tokens: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes * tokens


# config file stem -> shape (layers, KV heads, head dim as in the config's memory comment).
# prefill_tokens_per_s: an assumption (H200, bf16, long prompts), only used for the TTFT column.
MODEL_KV: dict[str, KVShape] = {
    "llama-3-8b": KVShape(32, 8, 128, prefill_tokens_per_s=20_000.0),
    "qwen3-32b": KVShape(64, 8, 128, prefill_tokens_per_s=5_000.0),
    "phi-4": KVShape(40, 10, 128, prefill_tokens_per_s=10_000.0),
    "qwen3-30b-a3b": KVShape(48, 4, 128, prefill_tokens_per_s=15_000.0),
    "smollm2-135m": KVShape(30, 3, 64, prefill_tokens_per_s=200_000.0),
}


@dataclass(frozen=True)
class FlowSpec:
    """One KV transfer in the workload."""

    fid: int
    arrival: float  # seconds: when the prefill is done and the transfer may start
    src: int  # prefill host
    dst: int  # decode host
    tokens: int
    nbytes: int
    prefill_s: float  # the prefill compute before it (the TTFT the fabric does not add)


def prefill_and_decode_hosts(topology: LeafSpine) -> tuple[list[int], list[int]]:
    """Prefill engines under the first half of the leaves, decode engines under the rest."""
    half = max(1, topology.num_leaves // 2)
    if topology.num_leaves < 2:
        raise ValueError("P/D traffic across spines needs at least two leaves")
    per = topology.hosts_per_leaf
    return list(range(half * per)), list(range(half * per, topology.num_hosts))


def poisson_pd_workload(topology: LeafSpine, model: str, load: float, num_flows: int, *,
                        min_tokens: int = 1024, max_tokens: int = 8192, seed: int = 0) -> list[FlowSpec]:
    """``num_flows`` transfers arriving as a Poisson process at ``load`` of the prefill hosts'
    NIC capacity; prompt lengths uniform in ``[min_tokens, max_tokens]``; each transfer from a
    uniformly drawn prefill host to a uniformly drawn decode host (always across the spines)."""
    if model not in MODEL_KV:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(MODEL_KV))}")
    if not 0 < load < 1:
        raise ValueError(f"load must be in (0, 1), got {load}")
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    shape = MODEL_KV[model]
    prefill, decode = prefill_and_decode_hosts(topology)
    rng = np.random.default_rng(seed)
    mean_bytes = shape.kv_bytes((min_tokens + max_tokens) / 2)
    capacity = len(prefill) * topology.capacity(topology.path(prefill[0], decode[0], 0)[0])
    rate = load * capacity / mean_bytes  # transfers per second
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num_flows))
    tokens = rng.integers(min_tokens, max_tokens + 1, size=num_flows)
    srcs = rng.choice(prefill, size=num_flows)
    dsts = rng.choice(decode, size=num_flows)
    return [
        FlowSpec(i, float(arrivals[i]), int(srcs[i]), int(dsts[i]), int(tokens[i]),
                 shape.kv_bytes(int(tokens[i])), float(tokens[i]) / shape.prefill_tokens_per_s)
        for i in range(num_flows)
    ]
