"""What the int8 activations of the ``avx512_vnni`` 4-bit kernel cost in accuracy on a real
model: teacher-forced next-token logits over a fixed English text, per CPU executor against
an fp32 one on the same dequantized weights.

Executors (``--builds``, each built in turn with ``$BLINK_CPU_Q4`` set while its weights are
packed, as the kernel is chosen at pack time):

- ``avx512_vnni``: bf16, the projections on the file's codes with x quantized to int8 per row
  and group of 32 channels (llama.cpp's Q8_0 activations), every step;
- ``avx512``: bf16, the projections on the codes with x as it is (vdpbf16ps), steps of at
  most 32 rows (the text goes in chunks of ``--chunk`` <= 32 tokens, so every step does; a
  build that would run a chunk on the bf16 copy is refused);
- ``avx2``: as ``avx512`` with FMAs, steps of at most 8 rows (needs ``--chunk`` <= 8);
- ``amx``: bf16 with the AMX kernel (the default on a Xeon with AMX);
- ``bf16``: bf16 without the codes (the packed bf16 copy of the dequantized weights);
- ``int8_ref``: the fp32 reference with every projection's and the head's input x replaced by
  its int8 rounding (:func:`blink.kernels.cpu.quant_linear.quantized_x`): the int8 activations'
  own cost, without the kernel (llama.cpp's Q8_1 arithmetic, m times the quantized sum(x);
  the kernel takes the exact sum);
- ``int8_ref_sum_x``: as ``int8_ref`` but, as the ``avx512_vnni`` kernel does, each group's
  minimum m (Q4_1, K-quants) multiplies the exact sum(x) and only ``d * q`` the int8 x: the
  kernel's arithmetic in fp32. ``avx512_vnni`` far from it would be a kernel fault; the two
  far from ``int8_ref`` is the cost of that choice.

The reference is ``--dtype float32`` on the dequantized weights. Prints per executor: top-1
agreement with the fp32 argmax, mean and max KL(fp32 || executor) in nats, max |logit
difference|, the text's perplexity, and the fp32 top-1 margin (logit gap to the second
choice) at the positions where the executor's argmax differs (near-ties flip, not clear
choices). The other GGUF of interest is a random-weight 1B (agreement only means something
there, its perplexity does not)::

    python -m benchmarks.bench_int8_quality
    python -m benchmarks.bench_int8_quality --model /opt/blink-peers/models/llama-1b-shaped/model-Q4_K_M.gguf

Accuracy only (no timing), so it may run on a loaded machine; tests/test_int8_activations.py
holds the int8 build to a bound on a shorter text.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

#: A fixed English text (~330 SmolLM2 tokens), written for this benchmark.
TEXT = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night, "
    "the keeper climbed the narrow stairs, trimmed the wick and wound the clockwork that turned the "
    "great lens, so that ships passing in the dark could find their way around the rocks. In winter "
    "the storms came from the north, and waves broke so high against the tower that salt covered "
    "the windows at the top. The keeper kept a logbook in which he wrote down the weather, the ships "
    "he saw and the hours he spent on watch. Most entries were short: wind from the west, light rain, "
    "two fishing boats returned before midnight. Some were longer, written on the nights when a ship "
    "had been lost or a crew had been pulled from the water by the lifeboat from the village below.\n\n"
    "When electricity reached the coast, engineers replaced the oil lamp with an electric bulb and "
    "the clockwork with a small motor. A few years later the light became fully automatic, and the "
    "last keeper left the tower. The logbooks were sent to a museum in the nearest town, where "
    "visitors can still read them today. Historians have used them to study how the climate of the "
    "region changed over the last century, because the keepers measured the temperature and the "
    "height of the tide at the same hours every day.\n\n"
    "Today the lighthouse is painted white and red, and a path leads from the car park to a small "
    "café at its foot. On clear days you can see the islands on the horizon, and in spring thousands "
    "of seabirds nest on the ledges of the cliff. The light still turns every night, although modern "
    "ships rely mostly on satellite navigation. Many sailors say they are glad to see it anyway: "
    "after a long voyage, a familiar light on the shore means that they are almost home."
)

BUILDS = ("avx512_vnni", "avx512", "avx2", "amx", "bf16", "int8_ref", "int8_ref_sum_x")


@dataclass
class Comparison:
    """One executor's teacher-forced logits against the reference's over the same tokens."""

    agreement: float  #: fraction of positions whose argmax is the reference's
    mean_kl: float  #: mean KL(reference || executor), nats
    max_kl: float  #: largest per-position KL
    max_abs_diff: float  #: largest |logit difference|
    ppl: float  #: perplexity of the text (next tokens) under the executor
    flip_margins: list[float]  #: the reference's top-1 margin at each position whose argmax differs


def perplexity(logits: Any, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ``ids[1:]`` given logits ``[len(ids), vocab]``
    (row i predicts token i + 1)."""
    import torch

    logp = torch.log_softmax(logits[:-1].double(), -1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).view(-1, 1)).mean().item()
    return math.exp(nll)


def compare(ref: Any, other: Any, ids: list[int]) -> Comparison:
    """The numbers of :class:`Comparison` for logits ``other`` against ``ref`` (both fp32
    ``[len(ids), vocab]``, teacher-forced over ``ids``)."""
    import torch

    ref, other = ref.double(), other.double()
    lp_ref, lp = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    top_ref, top = ref.argmax(-1), other.argmax(-1)
    two = ref.topk(2, dim=-1).values
    margins = (two[:, 0] - two[:, 1])[top_ref != top]
    return Comparison(
        agreement=(top_ref == top).double().mean().item(), mean_kl=kl.mean().item(), max_kl=kl.max().item(),
        max_abs_diff=(ref - other).abs().max().item(), ppl=perplexity(other, ids),
        flip_margins=sorted(margins.tolist()))


@contextlib.contextmanager
def kernel_build(build: str | None) -> Iterator[None]:
    """``$BLINK_CPU_Q4=build`` (None: unset, the CPU's choice) while executors are built in the
    block: the 4-bit kernel is chosen when the weights are packed, and the choice is forgotten
    before and after (:func:`blink.kernels.cpu.quant_linear.reset`, the AMX kernel's too)."""
    from blink.kernels.cpu import q4_linear as cpu_q4_linear, quant_linear as cpu_quant_linear

    previous = os.environ.get(cpu_q4_linear.IMPL_ENV)
    if build is None:
        os.environ.pop(cpu_q4_linear.IMPL_ENV, None)
    else:
        os.environ[cpu_q4_linear.IMPL_ENV] = build
    cpu_quant_linear.reset()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(cpu_q4_linear.IMPL_ENV, None)
        else:
            os.environ[cpu_q4_linear.IMPL_ENV] = previous
        cpu_quant_linear.reset()


def make_executor(files: Any, build: str, n_tokens: int, chunk: int = 32, block_size: int = 16) -> Any:
    """A CPU executor for ``build`` (one of :data:`BUILDS`, or ``float32``: the reference) with
    room for ``n_tokens`` tokens of one sequence in steps of ``chunk``; ValueError for a build
    that does not run here, did not take the projections (e.g. no oneDNN bf16 on this CPU) or
    runs steps of ``chunk`` tokens on the bf16 copy instead of the codes."""
    import torch

    from blink.executor import ModelExecutor
    from blink.kernels.cpu import q4_linear as cpu_q4_linear, quant_linear as cpu_quant_linear

    blocks = -(-n_tokens // block_size)
    kw = dict(block_size=block_size, num_blocks=blocks + 1, max_model_len=blocks * block_size, cpu_graphs=False)
    if build == "float32":
        return ModelExecutor(files, dtype=torch.float32, **kw)
    if build in ("int8_ref", "int8_ref_sum_x"):
        return int8_activations(ModelExecutor(files, dtype=torch.float32, **kw),
                                files if build == "int8_ref_sum_x" else None)
    if build == "bf16":
        return ModelExecutor(files, dtype=torch.bfloat16, int4_decode=False, **kw)
    if build in cpu_quant_linear.VARIANTS:
        missing = [f for f in cpu_quant_linear.VARIANTS[build][1] if f not in cpu_quant_linear.cpu_flags()]
        if missing:
            raise ValueError(f"this CPU cannot run the {build} build (no {' '.join(missing)})")
    elif build != "amx":
        raise ValueError(f"unknown build {build!r}: one of {', '.join(BUILDS)}")
    with kernel_build(None if build == "amx" else build):
        if build == "amx" and not cpu_q4_linear.available():
            raise ValueError("the AMX kernel does not run here (no AMX, compiler or permission)")
        ex = ModelExecutor(files, dtype=torch.bfloat16, **kw)
    kernels = {kernel for kernel, _ in ex.int4_kernels}
    if kernels != {build}:
        raise ValueError(f"the {build} build did not take the projections: they run "
                         f"{sorted(kernels) or 'no 4-bit kernel'} (packed bf16: {ex.packed_weights})")
    limit = min((rows for _, rows in ex.int4_kernels if rows is not None), default=None)
    if limit is not None and chunk > limit:
        raise ValueError(f"chunk {chunk}: the {build} build runs steps of at most {limit} tokens on the "
                         f"codes here (larger ones on the bf16 copy); use {limit} or less")
    return ex


#: a fused projection's parts, in its rows' order (blink.models.decoder)
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _minimums(files: Any, name: str, weight: Any) -> Any:
    """The fp32 ``[N, K]`` part of projection ``name``'s weight that its groups' minimums m
    make (``w = d q + m``; 0 where the format has none or the tensor is not coded), from the
    file's codes; checks ``d q + m`` is ``weight``."""
    import torch

    codes = getattr(files, "_bench_codes", None)
    if codes is None:
        codes = files._bench_codes = dict(files.iter_quant_codes())
    layer, _, kind = name.partition(".layers.")[2].partition(".")
    parts = [f"model.layers.{layer}.{p}.weight" for p in _FUSED.get(kind, (kind,))]
    if name == "lm_head" or any(p not in codes for p in parts):
        return torch.zeros_like(weight)
    mins = torch.cat([torch.zeros_like(codes[p].d).repeat_interleave(codes[p].group, 1) if codes[p].m is None
                      else codes[p].m.repeat_interleave(codes[p].group, 1) for p in parts])
    dense = torch.cat([codes[p].dequantize() for p in parts])
    if not torch.equal(dense, weight.float()):
        raise ValueError(f"{name}: the file's codes are not the executor's weight")
    return mins


def int8_activations(ex: Any, files: Any = None, quantize: Callable[[Any], Any] | None = None) -> Any:
    """``ex`` (an fp32 executor without 4-bit copies) with every projection's and the head's
    input rounded to int8 per row and group of 32 first, as the ``avx512_vnni`` kernel
    quantizes it (``quantize``, default :func:`blink.kernels.cpu.quant_linear.quantized_x`;
    tests pass a wrong one); with ``files`` (the model's GGUF), each group's minimum m times x
    as it is (the kernel's exact sum(x)) and only ``d q`` times the rounded x. Replaces what an
    earlier call set. Returns ``ex``."""
    import torch
    import torch.nn.functional as F

    from blink.kernels.cpu.quant_linear import quantized_x
    from blink.models.decoder import Linear

    quantize = quantize or quantized_x

    def rounded(f):
        return lambda x, *a, **kw: f(quantize(x).to(x.dtype), *a, **kw)

    def split(module: Any, mins: Any):
        return lambda x: F.linear(quantize(x), module.weight - mins, module.bias) + F.linear(x, mins)

    model = ex.model
    if ex.int4_projections[0] or ex.packed_weights or ex.dtype != torch.float32:
        raise ValueError("int8_activations wraps an fp32 executor on plain weights")
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            own = type(module).forward.__get__(module)  # (not an earlier call's)
            module.forward = rounded(own) if files is None else split(module, _minimums(files, name, module.weight))
    model.compute_logits = rounded(type(model).compute_logits.__get__(model))  # (a head without m: Q8_0, Q6_K)
    return ex


def plain(ex: Any) -> Any:
    """``ex`` without what :func:`int8_activations` set. Returns ``ex``."""
    for module in [ex.model, *ex.model.modules()]:
        for attr in ("forward", "compute_logits"):
            module.__dict__.pop(attr, None)
    return ex


def teacher_forced_logits(ex: Any, ids: list[int], chunk: int) -> Any:
    """fp32 logits ``[len(ids), vocab]`` of one sequence fed in steps of ``chunk`` tokens
    (every position's logits, row i predicting token i + 1)."""
    import torch

    from blink.kernels.attention_metadata import AttentionMetadata

    bs = ex.block_size
    blocks = list(range(-(-len(ids) // bs)))
    table = torch.tensor([blocks], dtype=torch.int32)
    out = []
    for start in range(0, len(ids), chunk):
        new = ids[start:start + chunk]
        positions = list(range(start, start + len(new)))
        md = AttentionMetadata(
            slot_mapping=torch.tensor([blocks[p // bs] * bs + p % bs for p in positions]),
            positions=torch.tensor(positions), token_seq_idx=torch.zeros(len(new), dtype=torch.int64),
            query_start_loc=torch.tensor([0, len(new)], dtype=torch.int32),
            seq_lens=torch.tensor([start + len(new)], dtype=torch.int32), block_tables=table,
            max_context=start + len(new), max_query_len=len(new))
        out.append(ex.execute(torch.tensor(new), md, torch.arange(len(new))))
    return torch.cat(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="a GGUF file or a name blink.loader.resolve_model knows (default: the SmolLM2-135M-Instruct Q4_1 GGUF)")
    p.add_argument("--builds", nargs="+", default=["avx512_vnni", "avx512", "bf16"], choices=BUILDS)
    p.add_argument("--chunk", type=int, default=32, help="tokens per step (<= 32: the avx512 build's codes limit)")
    p.add_argument("--tokens", type=int, default=None, help="use only the text's first N tokens")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()

    import torch
    from tokenizers import Tokenizer

    from blink.loader import open_model, resolve_model

    if args.chunk < 1:
        raise SystemExit(f"--chunk must be positive, got {args.chunk}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    files = open_model(path)
    ids = Tokenizer.from_str(files.tokenizer_json).encode(TEXT, add_special_tokens=False).ids
    ids = ids[:args.tokens] if args.tokens else ids
    print(f"{path}: {len(ids)} tokens in steps of {args.chunk}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)

    logits = {}
    for build in ["float32", *args.builds]:
        try:
            ex = make_executor(files, build, len(ids), args.chunk)
        except ValueError as exc:
            raise SystemExit(f"--builds {build}: {exc}") from None
        logits[build] = teacher_forced_logits(ex, ids, args.chunk)
        kernels = ", ".join(f"{k}<={r or 'all'}: {n}" for (k, r), n in sorted(ex.int4_kernels.items(),
                                                                             key=lambda kv: str(kv[0])))
        print(f"  {build}: built{' (' + kernels + ')' if kernels else ''}", flush=True)
        del ex

    ref = logits["float32"]
    print(f"\nfp32 perplexity {perplexity(ref, ids):.3f}\n")
    print(f"{'executor':<15} {'top-1 agree':>11} {'mean KL':>9} {'max KL':>9} {'max|dlogit|':>11} "
          f"{'ppl':>8}  argmax flips: fp32's top-1 margin (median, max)")
    for build in args.builds:
        c = compare(ref, logits[build], ids)
        m = c.flip_margins
        flips = f"{len(m)} ({m[len(m) // 2]:.2f}, {m[-1]:.2f})" if m else "0"
        print(f"{build:<15} {c.agreement:>11.4f} {c.mean_kl:>9.2e} {c.max_kl:>9.2e} {c.max_abs_diff:>11.3f} "
              f"{c.ppl:>8.3f}  {flips}")
    if "avx512_vnni" in logits and "avx512" in logits:  # int8 x against bf16 x on the same codes
        c = compare(logits["avx512"], logits["avx512_vnni"], ids)
        print(f"\navx512_vnni vs avx512 (same codes, int8 x vs bf16 x): top-1 agree {c.agreement:.4f}, "
              f"mean KL {c.mean_kl:.2e}, max |dlogit| {c.max_abs_diff:.3f}")


if __name__ == "__main__":
    main()
