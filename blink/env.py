"""Every ``BLINK_*`` environment variable, in one registry (issue 31).

Each :class:`EnvVar` says its name, its type and values, its default (what unset means),
what it does, who reads it, and its kind:

* ``user``: a knob for users and operators (most have a flag that wins over them);
* ``internal``: set by ``blink serve`` for its children (never set it by hand);
* ``debug``: diagnosis and tests (falls back to a reference path, dumps a file);
* ``benchmark``: read by the scripts under benchmarks/ only;
* ``test``: test hooks (may live outside the product's folders).

Code reads them through :func:`get` / :func:`pop` / :func:`is_true`, which refuse a name
that is not registered; ``blink --help-env`` prints the registry, and
``tests/test_env.py`` fails on any ``BLINK_`` name in blink/, dpu/, kernels/ or benchmarks/
that is not in it (or in :data:`NOT_ENVIRONMENT`). Torch-free and import-light.
"""
from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    #: bool | str | path | int | float | pid | choice (with ``values``)
    type: str
    #: what unset means
    default: str
    meaning: str
    #: the modules that read it
    readers: tuple[str, ...]
    kind: str = "user"
    values: tuple[str, ...] = ()


_FALSE = ("0", "false", "no", "off")

VARIABLES: tuple[EnvVar, ...] = (
    # -- user --------------------------------------------------------------------------------
    EnvVar("BLINK_API_KEY", "str", "no key (unless --api-key)",
           "the API key the frontend requires, where --api-key is not given (blink serve also "
           "passes --api-key to its frontend this way, off the command line)",
           ("blink.frontend_main", "blink.launcher")),
    EnvVar("BLINK_ENFORCE_EAGER", "bool", "1 (eager)",
           "CPU loop: 0 compiles the steps (as --compile); --enforce-eager / --compile win",
           ("blink.engine.compiled",)),
    EnvVar("BLINK_COMPILE_CACHE_DIR", "path", "~/.cache/blink/inductor ($XDG_CACHE_HOME)",
           "where compiled CPU steps are cached; --compile-cache-dir wins",
           ("blink.engine.compiled",)),
    EnvVar("BLINK_CPU_BF16", "bool", "detected from the CPU's flags",
           "whether the CPU counts as having native bf16 for --dtype auto (0: float32 on CPU)",
           ("blink.dtypes",)),
    EnvVar("BLINK_CPU_ATTENTION", "choice", "automatic (by a cost estimate per step)",
           "CPU paged attention: torch = always the torch path; c (the default where it builds) = "
           "the C kernel where its cost estimate wins, else the torch path",
           ("blink.kernels.cpu.attention",), values=("torch", "c")),
    EnvVar("BLINK_CPU_FUSED", "choice", "automatic",
           "CPU norms/SiLU/residual ops: torch = the references; c (the default where it builds) "
           "= the C ops",
           ("blink.kernels.cpu.fused",), values=("torch", "c")),
    EnvVar("BLINK_CPU_SAMPLER", "choice", "automatic",
           "the CPU sampler's seeded draw and top-k/top-p/min-p filter: torch = the references; "
           "c (the default where it builds) = the C ops (kernels/cpu/sampling.c)",
           ("blink.kernels.cpu.sampling",), values=("torch", "c")),
    EnvVar("BLINK_CPU_SCHED", "choice", "c (where a C compiler is found)",
           "the CPU loop's per-step scheduler stages (batch build, publishing the tokens, stats): "
           "torch = the torch reference; c = the C stages (kernels/cpu/sched.c)",
           ("blink.kernels.cpu.sched",), values=("torch", "c")),
    EnvVar("BLINK_CPU_AMX", "bool", "1 (AMX where the CPU, the compiler and the OS have it)",
           "0 = the CPU kernels act as on a CPU without AMX: paged attention without AMX tiles "
           "or AMX scores (its per-token pass on AVX-512), 4-bit projections off the AMX kernel "
           "(on the AVX-512 VNNI, AVX-512 BF16, AVX-VNNI, AVX2 int8, AVX2 or Arm NEON kernel the CPU's "
           "flags choose, as BLINK_CPU_Q4=avx512_vnni|avx512|avx2_vnni|avx2_int8|avx2|neon_dotprod "
           "would); benchmarks/peers.py --no-amx sets it",
           ("blink.kernels.cpu",)),
    EnvVar("BLINK_CPU_ISA", "choice", "the CPU's own flags",
           "avx2 = every choice made by the CPU's flags acts as on a CPU with AVX2 and no "
           "AVX-512, AVX-VNNI or AMX (AMD Zen 2/3, older Xeons): --dtype auto, the 4-bit kernel's "
           "build, AMX, and the C kernels' -march=native builds (-march=x86-64-v3); blink engine "
           "also sets torch's ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 where unset; "
           "benchmarks/peers.py --isa avx2 sets it; avx2_vnni = as on a CPU with AVX2 and AVX-VNNI "
           "but no AVX-512 or AMX (Alder Lake and later client cores, Sierra Forest: -march=x86-64-v3 "
           "-mavxvnni, torch at avx2 / AVX2_VNNI); avx512 = as on a CPU with AVX-512 and VNNI but "
           "no BF16 or AMX (Cascade Lake, Ice Lake: -march=cascadelake, torch at avx512 / "
           "AVX512_CORE_VNNI)",
           ("blink.shared.cpu_features", "blink.launcher"), values=("avx2", "avx2_vnni", "avx512")),
    EnvVar("BLINK_CPU_Q4", "choice", "chosen by the CPU's flags (AMX, else AVX-512 VNNI, else AVX-512 BF16, else AVX2 with AVX-VNNI, else AVX2 int8; Arm: NEON dot product)",
           "the kernel for projections on a GGUF file's quantized codes: torch = torch's int4 "
           "kernel / bf16 copy; avx512_vnni (int8 activations), avx512, avx2_vnni (AVX2 with AVX-VNNI, int8 "
           "activations), avx2_int8 (int8 activations), "
           "avx2 or neon_dotprod (Arm, int8 activations) = that build of the "
           "non-AMX kernel (and the "
           "AMX kernel off)",
           ("blink.kernels.cpu.q4_linear", "blink.kernels.cpu.quant_linear"),
           values=("torch", "avx512_vnni", "avx512", "avx2_vnni", "avx2_int8", "avx2", "neon_dotprod")),
    EnvVar("BLINK_CPU_HUGE_PAGES", "bool", "1 (where the kernel has transparent huge pages)",
           "0 = the model's weights and KV cache stay in torch's own (4 KB) pages instead of "
           "2 MB pages (blink.huge_pages)", ("blink.huge_pages",)),
    EnvVar("BLINK_FRONTEND_DOORBELL", "bool", "1 (on)",
           "0 = the frontend asks its engine for no doorbell (blink.transport.doorbell): its ring "
           "poller ticks on its timers alone, as with an engine on another host (the A/B of "
           "benchmarks/bench_frontend_cpu.py)",
           ("blink.frontend_main",), kind="debug"),
    EnvVar("BLINK_FRONTEND_POLL_ALIGN", "bool", "1 (on)",
           "0 = the frontend's ring poller, where it has no doorbell (an engine on another host), "
           "ticks on its backoff alone instead of sleeping through each engine step",
           ("blink.frontend_main",), kind="debug"),
    EnvVar("BLINK_NVRTC_LIB", "path", "the nvidia-cuda-nvrtc wheel's, else $CUDA_HOME's",
           "the NVRTC library that compiles the device loop's CUDA C",
           ("blink.kernels.cuda.nvrtc_build",)),
    EnvVar("BLINK_FUSED_SCHEDULER", "bool", "0 (off)",
           "GPU tiers: run the scheduler's fused Triton stages (issue 32; opt-in until "
           "measured on a GPU)", ("blink.engine.gpu.base",)),
    # -- debug -------------------------------------------------------------------------------
    EnvVar("BLINK_HOST_COPY", "choice", "the C copy loop where it builds",
           "python = the transport's Python copy loop even where the C one builds",
           ("blink.transport.host_copy",), kind="debug", values=("python",)),
    EnvVar("BLINK_GRAPH_DUMP_DIR", "path", "$OUT, else the temp dir",
           "tier B: where a CUDA graph that fails to instantiate is written (dot file)",
           ("blink.engine.gpu.tier_b",), kind="debug"),
    # -- internal ----------------------------------------------------------------------------
    EnvVar("BLINK_BOOTSTRAP_SECRET", "str", "none (a secret file, or a fresh secret)",
           "the bootstrap secret blink serve gives its children (removed from the environment "
           "as it is read); never on a command line",
           ("blink.transport.auth", "blink.launcher", "blink.frontend_main"), kind="internal"),
    EnvVar("BLINK_SUPERVISOR_PID", "pid", "none (a standalone process)",
           "the blink serve a child must die with (removed as it is read)",
           ("blink.supervision", "blink.launcher"), kind="internal"),
    EnvVar("BLINK_THREADS_SNAPSHOT", "path", "none (no snapshot)",
           "the file the engine publishes its threads' report in, for the frontend's /metrics",
           ("blink.threads.runtime", "blink.launcher"), kind="internal"),
    # -- tests -------------------------------------------------------------------------------
    EnvVar("BLINK_TEST_KV_READY_DELAY_S", "float", "0",
           "tests only: seconds a prefill engine waits between a prompt's KV and its ready word "
           "(leaving the product path with issue 31's runner interface)",
           ("blink.launcher",), kind="test"),
    EnvVar("BLINK_TEST_ANSWER", "choice", "the C library",
           "tests only: the switch of the test library of blink.shared.native_build",
           ("tests/test_native_build.py",), kind="test", values=("torch",)),
    # -- benchmarks --------------------------------------------------------------------------
    EnvVar("BLINK_PEERS_DIR", "path", "/opt/blink-peers",
           "where benchmarks/setup_peers.sh installs the peer servers (vLLM, llama.cpp, ...)",
           ("benchmarks.peers", "benchmarks/setup_peers.sh"), kind="benchmark"),
    EnvVar("BLINK_MODEL", "str", "the smollm2 GGUF",
           "benchmarks/setup_peers.sh: the model the peers are set up for",
           ("benchmarks/setup_peers.sh",), kind="benchmark"),
)

REGISTRY: dict[str, EnvVar] = {v.name: v for v in VARIABLES}

#: ``BLINK_`` names in the code that are not environment variables
NOT_ENVIRONMENT = {
    "BLINK_ENGINE_READY": "the line 'blink engine' prints on stdout when it serves",
    "BLINK_QUANT_INT8_PER_THREAD": "a C macro of kernels/cpu/quant_linear.c, which "
                                   "benchmarks/bench_forward.py --before int8-coarse-split builds with -D",
}

KINDS = (("user", "Knobs"), ("debug", "Diagnosis"), ("internal", "Set by blink serve for its "
         "children (do not set by hand)"), ("benchmark", "benchmarks/ scripts only"),
         ("test", "Tests only"))


def _registered(name: str) -> str:
    if name not in REGISTRY:
        raise KeyError(f"${name} is not in blink/env.py's registry: add it there")
    return name


def get(name: str, default: str | None = None) -> str | None:
    """``$name`` (a registered variable), else ``default``."""
    return os.environ.get(_registered(name), default)


def pop(name: str) -> str | None:
    """``$name``, removed from this process's environment (children do not inherit it)."""
    return os.environ.pop(_registered(name), None)


def choice(name: str) -> str:
    """``$name`` stripped and lower case; "" when unset."""
    return (get(name) or "").strip().lower()


def is_true(name: str, default: bool = False) -> bool:
    """A bool variable: unset or empty gives ``default``; 0/false/no/off False; else True."""
    value = choice(name)
    if not value:
        return default
    return value not in _FALSE


def help_text(width: int = 100) -> str:
    """The registry as ``blink --help-env`` prints it."""
    lines = ["Environment variables Blink reads (flags, where there is one, win):", ""]
    for kind, title in KINDS:
        variables = [v for v in VARIABLES if v.kind == kind]
        if not variables:
            continue
        lines.append(f"{title}:")
        for v in variables:
            kind_of = f"one of {'|'.join(v.values)}" if v.values else v.type
            lines.append(f"  {v.name}  ({kind_of}; unset: {v.default})")
            lines += textwrap.wrap(f"{v.meaning}. Read by {', '.join(v.readers)}.", width,
                                   initial_indent="      ", subsequent_indent="      ")
        lines.append("")
    lines.append("Thread knobs (--threads, --kernel-threads, OMP_WAIT_POLICY, --thread-policy): "
                 "docs/threads.md.")
    return "\n".join(lines)
