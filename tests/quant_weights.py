"""Random weights in each format the CPU kernel without AMX takes, and the products its builds
must give (tests/test_cpu_quant_linear.py, tests/test_cpu_quant_linear_arm.py)."""
from __future__ import annotations

import platform

import torch

from blink.kernels.cpu import quant_linear as q
from blink.loader.gguf_weights import KScales

#: the builds of this machine's architecture, which the tests run where the CPU has their flags
#: (the Arm one on x86: tests/test_cpu_quant_linear_arm.py, under qemu-user)
ARM = platform.machine().lower() in ("aarch64", "arm64")
MACHINE_BUILDS = [name for name in q.VARIANTS if (name == "neon_dotprod") == ARM]

#: (bits, group, with m, fp32 scales): Q4_1, Q4_0 (m = -8d), Q4_K, Q8_0, Q6_K, Q5_K
FORMATS = {"q4_1": (4, 32, True, False), "q4_0": (4, 32, True, False), "q4_k": (4, 32, True, True), "q8_0": (8, 32, False, False),
           "q6_k": (8, 16, False, True), "q5_k": (8, 32, True, True)}


def weight(fmt: str, n: int, k: int, seed: int = 0):
    """Random codes and scales of a format, as gguf_weights.QuantCodes holds them: (codes, d, m,
    group, bits, k_scales), a K-quant's d an fp16 per super-block of 256 channels times a small
    integer per group (its file scales in k_scales where k is whole super-blocks)."""
    bits, group, with_m, fp32 = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    elif fmt == "q6_k":
        codes = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    elif fmt == "q5_k":
        codes = torch.randint(0, 32, (n, k), generator=g, dtype=torch.int8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    if fp32:  # a K-quant's: fp16 d (dmin) per super-block times 6-bit sc (mn) or Q6_K's int8 sc
        supers, nsub = -(-k // 256), 256 // group
        wide = lambda v: v.float().repeat_interleave(nsub, 1)[:, : k // group]  # noqa: E731
        d_super = (torch.rand(n, supers, generator=g) * 0.05 + 0.001).half()
        low, high = (-128, 128) if fmt == "q6_k" else (1, 64)
        sc = torch.randint(low, high, (n, k // group), generator=g, dtype=torch.int8)
        sc[sc == 0] = 1
        # (a wrong code at [n / 2, k / 2] must move its column past its rounding: tests below)
        d_super[n // 2, k // 2 // 256] = 0.05
        sc[n // 2, k // 2 // group] = high - 1
        d = wide(d_super) * sc.float()
        dmin = mn = m = None
        if with_m:
            dmin = (torch.rand(n, supers, generator=g) * 0.02 - 0.002).half()
            mn = torch.randint(0, 64, (n, k // group), generator=g, dtype=torch.int8)
            m = -wide(dmin) * mn.float()
        return codes, d, m, group, bits, KScales(d_super, sc, dmin, mn) if k % 256 == 0 else None
    d = (torch.rand(n, k // group, generator=g) * 0.05 + 0.001).half().float()
    m = (-torch.rand(n, k // group, generator=g) * 0.3).half().float() if with_m else None
    if fmt == "q4_0":  # (q - 8) d: m = -8d, which the kernel forms
        m = -8 * d
    return codes, d, m, group, bits, None


#: bits a code takes in the kernel's layout (Q6_K's in 6, Q5_K's in 5)
CODE_BITS = {"q4_1": 4, "q4_0": 4, "q4_k": 4, "q8_0": 8, "q6_k": 6, "q5_k": 5}


def exact_product(build: str, fmt: str, x: torch.Tensor, codes, d, m, group: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product the build computes: x @ (d q + m).T, an int8 build's on
    quantize_activations' x (per 256 channels for a K-quant with the file's scales, else 32;
    the whole weight: its m multiplies the sum of the rounded x),
    in float64: exact here (fp32 weights and x, sums of at most a few thousand products), so
    that it does not depend on the order torch's fp32 matmul sums in on this CPU (on an AMD
    EPYC it put 6-9 of 128 extreme outputs a rounding edge away from the exact ones)."""
    n, k = codes.shape
    q_centered = codes.double() - (8 if fmt == "q4_0" else 0)
    scaled = (q_centered.view(n, k // group, group) * d.double()[..., None]).view(n, k)
    mins = None if m is None or fmt == "q4_0" else m.double().repeat_interleave(group, 1)
    k_quant = FORMATS[fmt][3] and k % q.SUPER == 0  # x per super-block (activation_group)
    xs = q.quantized_x(x, q.SUPER if k_quant else q.GROUP).double() if build in q.INT8_BUILDS else x.double()
    want = xs @ scaled.T + (0 if mins is None else xs @ mins.T)
    return want if bias is None else want + bias.double()


def close_to_exact(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """``got`` (bf16) is ``want`` (fp32) rounded, up to one bf16 step where the fp32 sums'
    order puts it on a rounding edge, in 1% of the outputs at most (2 in a small product)."""
    got = got.float()
    exact = want.to(torch.bfloat16).float()
    step = torch.maximum(want.abs() * 2.0 ** -7, magnitude * 2.0 ** -18)
    assert ((got - exact).abs() <= step).all()
    assert (got != exact).sum() <= max(2, 0.01 * got.numel())
