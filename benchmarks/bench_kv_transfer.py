"""KV transfer over the loopback transport vs a plain memcpy of the same bytes, in one run.

What a prefill engine does per request (blink.engine.kv_transfer.BlockWrite): for every
layer, K then V, write the prompt's blocks into the reserved blocks of the decode engine's KV
region (a shared-memory segment attached as a LoopbackTransport, as the bootstrap hands it
to a kv_writer). The baseline is ``torch.Tensor.copy_`` of one contiguous tensor of the same
byte count into another (the best a memcpy does), and numpy's ``copyto`` as a second one.

    python -m benchmarks.bench_kv_transfer [--tokens 2048] [--layout consecutive|shuffled] [--per-layer]

``--per-layer``: one write per layer, as the prefill engine's layer-by-layer streaming makes
them during the forward (the same bytes and copy list; what 30 calls cost over one).

Dimensions default to SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64, bf16). The machine
is shared: compare the ratio, printed from medians of interleaved repetitions.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

from blink.engine.kv_transfer import BlockWrite, KVLayout, cache_sources, write_blocks
from blink.transport.loopback import LoopbackRegion, LoopbackTransport


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens whose KV moves")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-blocks", type=int, default=1024, help="blocks of each KV cache")
    p.add_argument("--layout", default="consecutive", choices=["consecutive", "shuffled"],
                   help="block ids on both sides: consecutive (a fresh pool) or shuffled (a "
                        "fragmented one: one write per block)")
    p.add_argument("--per-layer", action="store_true",
                   help="one write per layer (layer-by-layer streaming) instead of one "
                        "for the whole transfer")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)

    layout = KVLayout(args.layers, args.num_blocks, args.block_size, args.kv_heads, args.head_dim, args.dtype)
    dtype = getattr(torch, args.dtype)
    shape = (args.num_blocks + 1, args.block_size, args.kv_heads, args.head_dim)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]
    n = -(-args.tokens // args.block_size)
    rng = random.Random(0)
    if args.layout == "consecutive":
        src, dst = list(range(3, 3 + n)), list(range(100, 100 + n))
    else:
        src, dst = rng.sample(range(args.num_blocks), n), rng.sample(range(args.num_blocks), n)
    nbytes = layout.bytes_for(args.tokens)

    region = LoopbackRegion(layout.total_bytes)
    transport = LoopbackTransport(region.name, layout.total_bytes)
    plain_src = torch.empty(nbytes, dtype=torch.uint8).random_()
    plain_dst = torch.empty(nbytes, dtype=torch.uint8)
    np_src, np_dst = plain_src.numpy(), plain_dst.numpy()
    sources = cache_sources(caches)  # the prefill engine's sender keeps these views
    # first touch of every page outside the timed part
    write_blocks(transport, layout, caches, src, dst, sources=sources)
    plain_dst.copy_(plain_src)

    def transfer() -> int:
        # as the prefill engine's sender: the copy list laid out and checked once per transfer
        blocks = BlockWrite(transport, layout, sources, src, dst)
        if not args.per_layer:
            return blocks.write()
        return sum(blocks.write(range(layer, layer + 1)) for layer in range(args.layers))

    t_kv, t_copy, t_np = [], [], []
    for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits all three alike
        t = time.perf_counter()
        moved = transfer()
        transport.fence()
        t_kv.append(time.perf_counter() - t)
        t = time.perf_counter()
        plain_dst.copy_(plain_src)
        t_copy.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(np_dst, np_src)
        t_np.append(time.perf_counter() - t)
    assert moved == nbytes, (moved, nbytes)
    # the bytes landed where the decode engine reads them
    remote = np.frombuffer(region.buffer, dtype=np.uint8)
    off = layout.offset(args.layers - 1, 1, dst[-1])
    want = caches[-1][1][src[-1]].contiguous().view(torch.uint8).numpy().reshape(-1)
    assert (remote[off : off + layout.block_nbytes] == want).all()

    def gbps(ts: list[float]) -> float:
        return nbytes / statistics.median(ts) / 1e9

    kv, cp, npc = gbps(t_kv), gbps(t_copy), gbps(t_np)
    print(f"KV of {args.tokens} tokens ({args.layers} layers x {args.kv_heads} KV heads x "
          f"{args.head_dim} x {args.dtype}, blocks of {args.block_size}, {args.layout}"
          f"{', per layer' if args.per_layer else ''}): "
          f"{nbytes / 2**20:.1f} MiB, {len(src)} blocks per layer and K/V")
    print(f"  loopback KV transfer  {kv:6.2f} GB/s")
    print(f"  torch copy_           {cp:6.2f} GB/s   ratio {kv / cp:.2f}")
    print(f"  numpy copyto          {npc:6.2f} GB/s   ratio {kv / npc:.2f}")
    transport.close()
    region.close()


if __name__ == "__main__":
    main()
