"""Compile every Triton kernel for a GPU target on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``) checks the kernels' *numerics* on CPU, but it is
lenient: it runs the kernel body as Python and never type-checks it the way the compiler
does. This module closes that gap ahead of time. It calls each public op with ``meta``
tensors of real model shapes (Llama-3-8B, Qwen3-32B, Qwen3-30B-A3B), records the launches
the op would make (grid, arguments, constexprs, num_warps/num_stages) instead of running
them, and compiles each one with Triton's CUDA backend down to a cubin (ptxas included)
for the chosen architecture (default sm_90, H100/H200). It reports shared memory,
registers and spills, and fails on anything a GPU would reject at launch.

Run it in a process where ``TRITON_INTERPRET`` is unset (the kernels must be decorated as
compiled JIT functions)::

    python -m blink.kernels.triton.compile_check [--arch 90]
"""
from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_MAX_SHARED_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_MAX_GRID_YZ = 65535


@dataclass
class Launch:
    """One recorded ``kernel[grid](...)`` call, specialised exactly as the JIT would."""

    scenario: str
    kernel: JITFunction
    grid: tuple[int, ...]
    signature: dict[str, str]
    constexprs: dict
    attrs: dict
    options: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def key(self) -> tuple:
        return (self.kernel.fn.__qualname__, tuple(self.signature.items()),
                repr(sorted(self.constexprs.items())), repr(sorted(self.attrs.items())),
                repr(sorted(self.options.items())))


@dataclass
class Report:
    launch: Launch
    shared_bytes: int = 0
    registers: int | None = None
    spill_bytes: int | None = None
    errors: list[str] = field(default_factory=list)


@contextlib.contextmanager
def record_launches(
    arch: int = 90, scenario: Callable[[], str] | None = None
) -> Iterator[list[Launch]]:
    """Within the block, ``kernel[grid](...)`` records a :class:`Launch` instead of running.

    Arguments go through the JIT's own binder for ``sm_<arch>``, so the recorded signature
    carries the same specialisation (16-byte divisibility of pointers and integers, integer
    1 as a constant) a real launch gets; that decides vectorisation and hence registers.
    """
    if triton.knobs.runtime.interpret:
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter never compiles kernels")
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    launches: list[Launch] = []
    original = JITFunction.run

    def fake_run(self: JITFunction, *args, grid, warmup, **kwargs):
        kwargs.setdefault("debug", False)
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        grid = tuple(grid(bound) if callable(grid) else grid)
        launches.append(Launch(scenario() if scenario else "", self, grid, signature,
                               constexprs, attrs, options.__dict__))

    JITFunction.run = fake_run
    try:
        yield launches
    finally:
        JITFunction.run = original


def _ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers per thread, spill store bytes) from ``ptxas -v`` on the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas Triton itself uses

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{arch}{'a' if arch == 90 else ''}", str(src),
             "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True,
        )
    text = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None)


def compile_launch(launch: Launch, arch: int) -> Report:
    """Compile one recorded launch for ``sm_<arch>`` and check it against the GPU's limits."""
    report = Report(launch)
    if any(g > _MAX_GRID_YZ for g in launch.grid[1:]) or launch.grid[0] >= 2**31:
        report.errors.append(f"grid {launch.grid} exceeds CUDA limits")
    try:
        src = ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.options)
    except Exception as exc:  # the whole point is to surface compiler errors
        report.errors.append(f"compile failed: {type(exc).__name__}: {exc}")
        return report
    report.shared_bytes = int(compiled.metadata.shared)
    limit = _MAX_SHARED_BYTES.get(arch, 99 * 1024)
    if report.shared_bytes > limit:
        report.errors.append(f"shared memory {report.shared_bytes} B > {limit} B")
    report.registers, report.spill_bytes = _ptxas_usage(compiled.asm["ptx"], arch)
    return report


def realistic_launches(arch: int = 90) -> list[Launch]:
    """Every op called with real model shapes on ``meta`` tensors (nothing is allocated)."""
    from blink.kernels.attention_metadata import AttentionMetadata
    from blink.kernels.reference import layers as reference
    from blink.kernels.triton import (
        activation as triton_activation,
        attention as triton_attention,
        mask as triton_mask,
        moe as triton_moe,
        norm_rope as triton_norm_rope,
        sampling as triton_sampling,
    )

    current = [""]
    dev = torch.device("meta")
    bf16 = torch.bfloat16

    def t(*shape, dtype=bf16):
        return torch.empty(*shape, dtype=dtype, device=dev)

    def attention_md(n_tokens: int, n_rows: int, max_blocks: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=t(n_tokens, dtype=torch.int64), positions=t(n_tokens, dtype=torch.int64),
            token_seq_idx=t(n_tokens, dtype=torch.int64),
            query_start_loc=t(n_rows + 1, dtype=torch.int32), seq_lens=t(n_rows, dtype=torch.int32),
            block_tables=t(n_rows, max_blocks, dtype=torch.int32),
        )

    with record_launches(arch, lambda: current[0]) as launches:
        # name: (q heads, kv heads, head dim, hidden, intermediate)
        for name, (hq, hkv, d, hidden, inter) in {
            "llama3-8b": (32, 8, 128, 4096, 14336),
            "qwen3-32b": (64, 8, 128, 5120, 25600),
            "phi-3-mini": (32, 32, 96, 3072, 8192),
        }.items():
            for phase, n_tokens, n_rows in (("decode", 256, 256), ("prefill", 8192, 256)):
                current[0] = f"{name} {phase} T={n_tokens}"
                x = t(n_tokens, hidden)
                w = t(hidden)
                triton_norm_rope.rms_norm(x, w, 1e-5)
                triton_norm_rope.fused_add_rms_norm(x, x, w, 1e-5)
                qkv = t(n_tokens, (hq + 2 * hkv) * d)
                q = qkv[:, : hq * d].view(n_tokens, hq, d)
                k = qkv[:, hq * d : (hq + hkv) * d].view(n_tokens, hkv, d)
                triton_norm_rope.rms_norm(q, t(d), 1e-6)  # Qwen3 q/k norm
                triton_norm_rope.apply_rope(q, k, t(n_tokens, dtype=torch.int64),
                                            t(131072, d, dtype=torch.float32))
                triton_activation.silu_and_mul(t(n_tokens, 2 * inter))
                k_cache, v_cache = t(4096, 16, hkv, d), t(4096, 16, hkv, d)
                triton_attention.write_kv_cache(k, k, k_cache, v_cache, t(n_tokens, dtype=torch.int64))
                md = attention_md(n_tokens, n_rows, 8192 // 16)
                triton_attention.paged_attention(q.contiguous(), k_cache, v_cache, md, d**-0.5)
        # Decode at batch 1 over a long context: the split-K path with many splits.
        current[0] = "llama3-8b decode B=1 ctx=32K"
        triton_attention.paged_attention(t(1, 32, 128), t(4096, 16, 8, 128), t(4096, 16, 8, 128),
                                         attention_md(1, 1, 32768 // 16), 128**-0.5)
        # Qwen3-30B-A3B MoE: 128 experts, top-8, hidden 2048, expert intermediate 768.
        for n_tokens in (1, 64, 4096):
            current[0] = f"qwen3-30b-a3b moe T={n_tokens}"
            weights, ids = triton_moe.moe_topk_route(t(n_tokens, 128), 8, True)
            triton_moe.moe_experts(t(n_tokens, 2048), t(128, 2 * 768, 2048), t(128, 2048, 768),
                                   weights, ids)
        # fp32 activations (tests on a GPU, fp32 models): the IEEE-precision dot branches.
        current[0] = "fp32 small"
        f32 = torch.float32
        triton_attention.paged_attention(t(8, 4, 64, dtype=f32), t(64, 16, 2, 64, dtype=f32),
                                         t(64, 16, 2, 64, dtype=f32), attention_md(8, 2, 4), 0.125)
        weights, ids = triton_moe.moe_topk_route(t(8, 16, dtype=f32), 2, False)
        triton_moe.moe_experts(t(8, 64, dtype=f32), t(16, 128, 64, dtype=f32), t(16, 64, 64, dtype=f32),
                               weights, ids)
        # Samplers at Qwen3's and Llama-3's vocabulary sizes.
        for vocab in (151936, 128256):
            current[0] = f"sampling V={vocab}"
            logits = t(256, vocab, dtype=torch.float32)
            rows = (t(256, dtype=torch.int32), t(256, dtype=torch.float32), t(256, dtype=torch.float32))
            triton_sampling.apply_top_k_top_p_min_p(logits, *rows)
            triton_sampling.sample(logits, t(256, dtype=torch.int64), t(256, dtype=torch.int64))
            triton_sampling.uniform(t(256, dtype=torch.int64), t(256, dtype=torch.int64), vocab)
            masks = (t(256, dtype=torch.int32), t(256, dtype=torch.int32),
                     t(256, dtype=torch.int32), t(256, dtype=torch.int32))
            triton_mask.wait_token_masks(*masks, 1.0)
            triton_mask.apply_token_mask(logits, t(256, -(-vocab // 32), dtype=torch.int32), *masks)
    return launches


def compile_unique(launches: list[Launch], arch: int = 90) -> list[Report]:
    """Compile each distinct launch of ``launches`` once."""
    unique: dict[tuple, Launch] = {}
    for launch in launches:
        unique.setdefault(launch.key(), launch)
    return [compile_launch(launch, arch) for launch in unique.values()]


def compile_all(arch: int = 90) -> list[Report]:
    """Compile each distinct recorded launch of :func:`realistic_launches` once."""
    return compile_unique(realistic_launches(arch), arch)


def print_reports(reports: list[Report], arch: int) -> int:
    """The reports as a table (a kernel a line, its spill bytes last), then a line counting
    the errors; returns that count."""
    failed = 0
    print(f"{'kernel':28} {'scenario':32} {'warps':>5} {'smem KB':>8} {'regs':>5} {'spill B':>8}")
    for r in reports:
        lc = r.launch
        print(f"{lc.name:28} {lc.scenario:32} {lc.options['num_warps']:>5} "
              f"{r.shared_bytes / 1024:>8.1f} {r.registers if r.registers is not None else '?':>5} "
              f"{r.spill_bytes if r.spill_bytes is not None else '?':>8}")
        for err in r.errors:
            failed += 1
            print(f"    ERROR: {err}")
    kernels = sorted({r.launch.name for r in reports})
    print(f"{len(reports)} launches of {len(kernels)} kernels compiled for sm_{arch}; {failed} error(s)")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 or 80")
    args = parser.parse_args(argv)
    return 1 if print_reports(compile_all(args.arch), args.arch) else 0


if __name__ == "__main__":
    sys.exit(main())
