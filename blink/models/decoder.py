"""One decoder-only transformer for every supported family (Llama, Mistral, Qwen2, Qwen3,
Phi-3/Phi-4, Qwen3-MoE).

The families differ only in flags of :class:`~blink.model_config.ModelConfig` (biases, q/k norm,
rotary dim, rope scaling, MoE layers, tied embeddings); the checkpoint layout differences
(separate vs fused q/k/v and gate/up, per-expert vs stacked experts) are absorbed by
:meth:`DecoderForCausalLM.load_weights`.

The forward pass works on a flattened batch: all sequences' new tokens side by side,
described by an :class:`~blink.kernels.attention_metadata.AttentionMetadata`. Every op except the
projections goes through ``blink.kernels.ops_for(device)``, so GPU kernels replace the torch
references without this file changing. The projections' back-end depends on how each weight
was loaded, so it is chosen once, at load (:meth:`DecoderForCausalLM.use_packed_weights`,
:meth:`~DecoderForCausalLM.use_int4_weights`, :meth:`~DecoderForCausalLM.use_q8_head`), and
named in one start-log line (:meth:`DecoderForCausalLM.matmul_backend`). Nothing here loops over requests or reads a tensor
value on the host.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from blink.model_config import ModelConfig
from blink.errors import ModelLoadError
from blink.kernels import ops_for
from blink.kernels.cpu import q4_linear as cpu_q4_linear
from blink.kernels.attention_metadata import AttentionMetadata
from blink.kernels.reference.layers import rope_cos_sin_cache
from blink.models import int4_linear, packed_linear

KVCache = tuple[torch.Tensor, torch.Tensor]


#: Steps with at most this many logits rows take the Q8_0 head (:meth:`DecoderForCausalLM.use_q8_head`).
#: Measured on SmolLM2 (49152 x 576 head), one thread, Xeon with AMX: whole decode steps 1.14x
#: faster at 1 row, 1.03x at 16, the same at 32-64, where the kernel rebuilds the head's bf16
#: weights per call (docs/performance.md#q8-head).
Q8_HEAD_MAX_ROWS = 32


def _param(*shape: int) -> nn.Parameter:
    """Uninitialised parameter in the default dtype/device (set by :func:`build_model`);
    ``load_weights`` fills it in place, so the weights are never held twice."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)``; weight [out, in] as in HF checkpoints, or the same
    weight packed for oneDNN (:meth:`pack`, bf16 on CPU). ``int4``, when set, is the
    checkpoint's own 4-bit copy of the weight, used for the inputs whose row count it takes
    (:mod:`blink.models.int4_linear`; with the AMX kernel all of them, and :meth:`pack` drops
    the bf16 weight)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.packed = False
        self.int4: int4_linear.Int4Weight | None = None

    def pack(self) -> None:
        """Replace the weight by its oneDNN-packed form (the plain one is freed). Where the
        4-bit copy runs every step, the bf16 weight would never be read: it is dropped
        (an empty tensor) instead, saving 2 bytes per weight."""
        if not self.drop_unread_weight():
            self.weight = nn.Parameter(packed_linear.pack(self.weight), requires_grad=False)
        self.packed = True

    def drop_unread_weight(self) -> bool:
        """Free the bf16 weight (an empty tensor in its place) where the 4-bit copy runs every
        step, so that nothing reads it. Returns whether it was dropped."""
        if self.int4 is None or not self.int4.every_step:
            return False
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return True

    def gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a fused gate/up projection: ``silu(gate) * up`` in one call where its 4-bit AMX
        weight takes the step with the codes as they are (the kernel applies the activation
        as it stores its results, with the bits of this projection followed by the op
        table's SiLU); None elsewhere. Larger steps keep the SiLU apart: fused there, it was
        measured slower (2.59-2.66 against 2.06-2.20 ms for SmolLM2's [512, 576] x [576, 3072] on one
        core: the SiLU's vector work no longer hides behind the tile products)."""
        rows = x.shape[0]
        if (self.int4 is None or not self.int4.gates or not self.int4.takes(rows)
                or not self.int4.on_amx(rows) or rows > cpu_q4_linear.few_rows()):
            return None
        return int4_linear.linear(x, self.int4, self.bias, gated=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None and self.int4.takes(x.shape[0]):
            return int4_linear.linear(x, self.int4, self.bias)
        if self.packed:
            return packed_linear.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Holds the weight; the op itself comes from the kernel table."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = _param(dim)


class Attention(nn.Module):
    """Fused qkv projection, optional per-head q/k RMSNorm, RoPE, paged KV cache write,
    paged attention, output projection."""

    def __init__(self, config: ModelConfig, ops) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias)
        self.q_norm = RMSNorm(self.head_dim) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        md: AttentionMetadata,
        kv_cache: KVCache,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        ops = self.ops
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm.weight, self.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.eps)
        q, k = ops.apply_rope(q, k, md.positions, cos_sin)
        k_cache, v_cache = kv_cache
        ops.write_kv_cache(k, v, k_cache, v_cache, md.slot_mapping)
        o = ops.paged_attention(q, k_cache, v_cache, md, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one projection."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, ops) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias)
        self.down_proj = Linear(intermediate, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activation = self.gate_up_proj.gated(x)  # one pass where the 4-bit kernel fuses it
        if activation is None:
            activation = self.ops.silu_and_mul(self.gate_up_proj(x))
        return self.down_proj(activation)


class Experts(nn.Module):
    """All experts' weights stacked: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]."""

    def __init__(self, n_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w13 = _param(n_experts, 2 * intermediate, hidden)
        self.w2 = _param(n_experts, hidden, intermediate)


class SparseMoE(nn.Module):
    """Router (``gate``) + top-k experts, as in Qwen3-MoE."""

    def __init__(self, config: ModelConfig, ops) -> None:
        super().__init__()
        self.ops = ops
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.moe_topk_route(self.gate(x), self.top_k, self.renormalize)
        return self.ops.moe_experts(x, self.experts.w13, self.experts.w2, weights, ids)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ops) -> None:
        super().__init__()
        self.ops = ops
        self.eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attn = Attention(config, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        if config.is_moe_layer(layer):
            self.mlp: nn.Module = SparseMoE(config, ops)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        md: AttentionMetadata,
        kv_cache: KVCache,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        if residual is None:
            residual = x
            x = ops.rms_norm(x, self.input_layernorm.weight, self.eps)
        else:
            x, residual = ops.fused_add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        x = self.self_attn(x, md, kv_cache, cos_sin)
        x, residual = ops.fused_add_rms_norm(
            x, residual, self.post_attention_layernorm.weight, self.eps
        )
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, ops) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, ops) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size)


class DecoderForCausalLM(nn.Module):
    """The whole model. ``forward`` returns final hidden states [T, H] of the flattened
    batch; ``compute_logits`` projects the rows that need logits."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.ops = ops_for(device)
        self.model = DecoderModel(config, self.ops)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        cos_sin = rope_cos_sin_cache(
            config.rotary_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        self.register_buffer("cos_sin", cos_sin.to(device), persistent=False)
        #: Called after each decoder layer when set (host loops only, never in a captured
        #: graph): the CPU loop bumps the engine heartbeat here, so one long step (a big
        #: prefill on a loaded CPU) still shows the frontend that the loop makes progress.
        self.on_layer: Callable[[], None] | None = None
        #: the tied embedding packed for oneDNN as the head's weight (:meth:`use_packed_weights`)
        self.packed_head: torch.Tensor | None = None
        #: the tied embedding's own 4-bit copy as the head's weight for few rows
        #: (:meth:`use_int4_weights`)
        self.int4_head: int4_linear.Int4Weight | None = None
        #: the head's own 8-bit (Q8_0) codes on the AMX kernel, for steps whose logits rows are
        #: at most :data:`Q8_HEAD_MAX_ROWS` (:meth:`use_q8_head`); like the projections' AMX
        #: weights, steps of few rows on the int8 VNNI build over the same codes (its
        #: ``int8_view``: :data:`blink.models.int4_linear.INT8_MAX_ROWS_BESIDE_AMX_KERNEL`)
        self.q8_head: int4_linear.Int4Weight | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        md: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids [T] -> hidden [T, hidden_size] (after the final norm)."""
        return self.run_layers(self.embed(input_ids), md, kv_caches)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the token embeddings [T, hidden_size], the layers' input."""
        return F.embedding(input_ids, self.model.embed_tokens.weight)

    def run_layers(self, x: torch.Tensor, md: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """Embeddings [T, hidden_size] -> hidden [T, hidden_size] (after the final norm): the
        forward after :meth:`embed`."""
        # A fresh step cache per forward: ops memoise per-step index work in it once
        # and every layer reuses it (see AttentionMetadata.step_cache).
        md = dataclasses.replace(md, step_cache={})
        residual = None
        on_layer = self.on_layer
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, md, kv_cache, self.cos_sin)
            if on_layer is not None:
                on_layer()
        x, _ = self.ops.fused_add_rms_norm(x, residual, self.model.norm.weight, self.config.rms_norm_eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab] in the model dtype."""
        if self.q8_head is not None and self.q8_head.takes(hidden.shape[0]):
            return int4_linear.linear(hidden, self.q8_head, None)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.int4_head is not None and self.int4_head.takes(hidden.shape[0]):
            return int4_linear.linear(hidden, self.int4_head, None)
        if self.packed_head is not None:
            return packed_linear.linear(hidden, self.packed_head, None)
        return F.linear(hidden, self.model.embed_tokens.weight)

    def use_ops(self, ops) -> None:
        """Switch every module to another op table (the compiled CPU step's,
        :func:`blink.kernels.ops.compiled_cpu_ops`); the signatures are the same."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def use_packed_weights(self) -> None:
        """Pack every projection weight (and the head) for oneDNN's bf16 kernels on CPU,
        one tensor at a time (:mod:`blink.models.packed_linear`). A tied embedding stays
        plain for the lookup, and the head gets a packed copy of it (vocab x hidden more
        bytes). Eager only: a compiled step traces the plain weights."""
        for module in self.modules():
            if isinstance(module, Linear) and not module.packed:
                module.pack()
        head_on_int4 = self.int4_head is not None and self.int4_head.every_step
        if self.lm_head is None and self.packed_head is None and not head_on_int4:
            self.packed_head = packed_linear.pack(self.model.embed_tokens.weight)

    def drop_unread_weights(self) -> int:
        """Where the weights stay plain (no packing: oneDNN without native bf16, e.g. an AVX2
        CPU), free the bf16 weight of every projection whose 4-bit copy runs every step (the
        int8 kernel's), as :meth:`use_packed_weights` does. A tied embedding stays (the
        lookup reads it). Returns how many were dropped."""
        return sum(m.drop_unread_weight() for m in self.modules() if isinstance(m, Linear) and not m.packed)

    def use_int4_weights(self, q4_tensors: Iterable[tuple[str, Any]],
                         empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
                         progress: bool = True) -> tuple[int, int]:
        """Give each projection whose every row the checkpoint stores as codes (``q4_tensors``:
        ``(hf_name, codes)``, :class:`blink.loader.gguf_weights.QuantCodes` or the older
        :class:`~blink.loader.gguf_weights.Q4Codes`) a copy on those codes for the steps its
        kernel takes (:func:`blink.models.int4_linear.pack_codes`: every step on AMX, else
        steps of few tokens). A fused projection gets one only if a kernel takes all its parts
        (the kernel without AMX takes each part in its own format, so a Q4_K_M file's Q4_K q/k
        and Q6_K v make one copy; others keep the bf16 weight). A tied head the file stores as
        Q8_0 is left to :meth:`use_q8_head` where the AMX kernel runs. Call it before
        :meth:`use_packed_weights` (it locates rows in the plain weights), which drops the bf16
        copy of each projection whose 4-bit copy runs every step. ``empty``: the codes' memory,
        as :func:`blink.models.int4_linear.pack_codes` takes it; ``progress``: a "Packing codes"
        progress bar on stderr (seconds at 1B). Returns (projections given a copy on
        codes, projections in all)."""
        from tqdm import tqdm

        from blink.loader.gguf_weights import QuantCodes

        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        # parameter name -> [(first row, codes)], the parts of a fused weight
        parts: dict[str, list] = {}
        for name, codes in q4_tensors:
            if not isinstance(codes, QuantCodes):  # Q4Codes: (q - 8) scale + zero
                codes = QuantCodes("Q4_1", codes.codes, codes.scale, codes.zero - 8 * codes.scale,
                                   int4_linear.GROUP, 4)
            target = self._destination(name, params, self.config.source or None)
            if target is None:
                continue
            pname, dst = target
            module_name, _, leaf = pname.rpartition(".")
            module = modules.get(module_name)
            is_head = pname == "model.embed_tokens.weight" and self.lm_head is None
            if leaf != "weight" or (not is_head and (not isinstance(module, Linear) or module.packed)):
                continue
            if is_head and codes.qtype == "Q8_0" and cpu_q4_linear.available():
                continue  # use_q8_head's AMX kernel
            if dst.dim() != 2 or tuple(codes.codes.shape) != tuple(dst.shape) or dst.shape[1] % int4_linear.GROUP:
                continue
            full = params[pname]
            first_row = (dst.data_ptr() - full.data_ptr()) // (full.stride(0) * full.element_size())
            parts.setdefault(pname, []).append((first_row, codes))
        given = 0
        for pname, found in tqdm(parts.items(), desc="Packing codes for the CPU kernels", unit="weight",
                                 disable=not progress or not parts):
            found.sort(key=lambda part: part[0])
            row = 0
            for first_row, codes in found:
                if first_row != row:
                    break
                row += codes.codes.shape[0]
            if row != params[pname].shape[0]:
                continue  # some rows are in another format
            weight = int4_linear.pack_codes([codes for _, codes in found], empty=empty)
            if weight is None:
                continue
            if pname == "model.embed_tokens.weight":
                self.int4_head = weight
            else:
                modules[pname.rpartition(".")[0]].int4 = weight
            given += 1
        total = sum(isinstance(m, Linear) for m in self.modules()) + (self.lm_head is None)
        return given, total

    def use_q8_head(self, q8_tensors: Iterable[tuple[str, Any]]) -> bool:
        """Compute the logits from the head's own Q8_0 codes on the AMX kernel
        (:func:`blink.kernels.cpu.q4_linear.pack_q8`) where the checkpoint stores the head so
        (``q8_tensors``: ``(hf_name, codes)`` with ``codes.codes / .scale`` as
        :class:`blink.loader.gguf_weights.Q8Codes`; a tied embedding counts) and the kernel runs
        here: for steps of at most :data:`Q8_HEAD_MAX_ROWS` logits rows, half the bf16 head's
        bytes; larger ones keep the bf16 head, which rebuilding the head's 8-bit weights per
        call does not beat. Returns whether the head got one."""
        if not cpu_q4_linear.available():
            return False
        head = "lm_head.weight" if self.lm_head is not None else "model.embed_tokens.weight"
        params = dict(self.named_parameters())
        for name, q8 in q8_tensors:
            target = self._destination(name, params, self.config.source or None)
            if target is None or target[0] != head or tuple(q8.codes.shape) != tuple(params[head].shape):
                continue
            packed = cpu_q4_linear.pack_q8(q8.codes, q8.scale)
            self.q8_head = None if packed is None else int4_linear.amx_weight(packed, Q8_HEAD_MAX_ROWS)
            return self.q8_head is not None
        return False

    def int4_kernels(self) -> dict[tuple[str, int | None], int]:
        """How many projections (and the head) have a 4-bit copy, per (kernel, max rows;
        None: every step)."""
        weights = [m.int4 for m in self.modules() if isinstance(m, Linear) and m.int4 is not None]
        if self.int4_head is not None:
            weights.append(self.int4_head)
        kernels: dict[tuple[str, int], int] = {}
        for weight in weights:
            kernels[(weight.kernel, weight.max_rows)] = kernels.get((weight.kernel, weight.max_rows), 0) + 1
        return kernels

    def matmul_backend(self) -> str:
        """The projections' back-end as the load chose it, in one line (the engine's start log):
        the weights' kernel (oneDNN on weights packed at load, else torch's linear), which
        4-bit kernel takes how many projections on the checkpoint's codes and for which steps,
        and the Q8_0 head. Every call of :class:`Linear` and :meth:`compute_logits` follows
        this choice (only a 4-bit copy for small steps looks at the step's row count)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        dtype = str(self.model.embed_tokens.weight.dtype).removeprefix("torch.")
        if any(m.packed for m in linears):
            parts = [f"oneDNN on {dtype} weights packed at load"]
        else:
            parts = [f"torch's linear on plain {dtype} weights"]
        kernels = self.int4_kernels()
        if kernels:
            given = sum(kernels.values())
            per_kernel = ", ".join(
                f"{count} on the {kernel} kernel for "
                + ("every step, without a bf16 copy" if rows is None else f"steps of at most {rows} tokens")
                for (kernel, rows), count in kernels.items())
            parts.append(f"{given} projections on the checkpoint's 4-bit codes ({per_kernel})")
            viewed = sum(1 for m in linears if m.int4 is not None and m.int4.int8_view is not None)
            if viewed:
                parts.append(f"steps of at most {int4_linear.INT8_MAX_ROWS_BESIDE_AMX_KERNEL} tokens take "
                             f"{viewed} of the amx kernel's on the avx512_vnni kernel, on the same codes")
        if self.q8_head is not None:
            parts.append(f"the logits of steps of at most {Q8_HEAD_MAX_ROWS} rows on the head's own "
                         "8-bit (Q8_0) codes, on the AMX kernel"
                         + (f" (at most {int4_linear.INT8_MAX_ROWS_BESIDE_AMX_KERNEL} rows on the avx512_vnni "
                            "kernel, on the same codes)" if self.q8_head.int8_view is not None else ""))
        return "; ".join(parts)

    def place_weights(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every weight a step streams (the parameters, the copies on codes, the packed
        and 8-bit heads; the embedding where it is also the only head) by ``place``'s copy of
        it, one tensor at a time (the executor moves them to 2 MB pages,
        :mod:`blink.huge_pages`; ``place`` returns a tensor it cannot move, such as oneDNN's
        opaque packed weights, as it is). Call it after packing, before any graph records the
        weights' addresses."""
        # The embedding is read a few rows a step, unless it is also the head with no other copy.
        embedding = self.model.embed_tokens.weight
        lookup_only = not (self.lm_head is None and self.q8_head is None and self.int4_head is None
                           and self.packed_head is None)
        with torch.no_grad():
            for param in self.parameters():
                if not (lookup_only and param is embedding):
                    param.data = place(param.data)
        for module in self.modules():
            if isinstance(module, Linear) and module.int4 is not None:
                module.int4 = int4_linear.placed(module.int4, place)
        if self.int4_head is not None:
            self.int4_head = int4_linear.placed(self.int4_head, place)
        if self.q8_head is not None:
            self.q8_head = int4_linear.placed(self.q8_head, place)
        if self.packed_head is not None:
            self.packed_head = place(self.packed_head)

    def use_input_major_weights(self) -> None:
        """Store every projection weight (and a tied embedding) input-major in memory,
        keeping its [out, in] shape: on CPU, fp32 matrix-vector products read [in, out]
        memory about 1.7x faster than [out, in] (measured here; bf16 gains nothing). One
        tensor is copied at a time."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, Linear):
                    module.weight.data = module.weight.data.t().contiguous().t()
            if self.lm_head is None:
                embed = self.model.embed_tokens.weight
                embed.data = embed.data.t().contiguous().t()

    # ------------------------------------------------------------------ weight loading

    def unread_plain_weights(self) -> set[str]:
        """Names of the projection weights no step reads in their plain form: those whose
        4-bit copy runs every step (:meth:`use_int4_weights`; packing or
        :meth:`drop_unread_weights` drops them). A tied embedding is never one (the lookup
        reads it)."""
        return {f"{name}.weight" for name, module in self.named_modules()
                if isinstance(module, Linear) and module.int4 is not None and module.int4.every_step}

    def parameter_of(self, hf_name: str, params: dict[str, nn.Parameter] | None = None) -> str | None:
        """The parameter an HF-named tensor fills (None: one ``load_weights`` ignores);
        ``params``: ``dict(self.named_parameters())`` when the caller asks for many names."""
        params = dict(self.named_parameters()) if params is None else params
        target = self._destination(hf_name, params, self.config.source or None)
        return None if target is None else target[0]

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str | Path | None = None,
        unread: Iterable[str] = (), adopt: bool = False,
    ) -> None:
        """Copy HF-named tensors into the (fused) parameters, one tensor at a time.

        Accepts q/k/v and gate/up either separate or fused, and MoE experts either per
        expert (``mlp.experts.{e}.gate_proj.weight``) or stacked (``mlp.experts.gate_up_proj``).
        ``unread``: parameters no step reads (:meth:`unread_plain_weights`): they stay unfilled
        until packing drops them, and ``weights`` may leave them out (what it gives for them is
        checked, not copied).
        ``adopt``: each tensor is the caller's to give away, in memory of its own (a GGUF
        file's dequantized tensors; not safetensors', which may be views of the file): a
        whole parameter of its dtype takes the tensor itself rather than a copy (a 1B
        model's bf16 embedding: 0.5 GB less memory touched at load).
        Raises :class:`ModelLoadError` naming the tensor on an unexpected name, a shape
        mismatch, a tensor given twice, or weights left missing at the end.
        """
        source = source if source is not None else self.config.source or None
        params = dict(self.named_parameters())
        filled = dict.fromkeys(params, 0)  # elements written per parameter
        unread = set(unread)
        for name in unread:
            filled[name] = params[name].numel()
        seen: set[str] = set()
        for name, tensor in weights:
            target = self._destination(name, params, source)
            if target is None:
                continue
            pname, dst = target
            if tensor.shape != dst.shape:
                raise ModelLoadError(
                    source,
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}",
                )
            if pname in unread:
                if name in seen:
                    raise ModelLoadError(source, f"weight {name!r} is given twice")
                seen.add(name)
                continue
            filled[pname] += dst.numel()
            if name in seen or filled[pname] > params[pname].numel():
                raise ModelLoadError(source, f"weight {name!r} is given twice (or overlaps a fused weight)")
            seen.add(name)
            whole = params[pname]
            with torch.no_grad():
                if (adopt and dst.shape == whole.shape and tensor.dtype == whole.dtype
                        and tensor.device == whole.device and tensor.is_contiguous()):
                    whole.data = tensor
                else:
                    dst.copy_(tensor)
        missing = [p for p, n in filled.items() if n < params[p].numel()]
        if missing:
            shown = ", ".join(self._hf_names(p, seen) for p in missing[:6])
            more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
            raise ModelLoadError(source, f"missing weight(s): {shown}{more}")

    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
    _QKV = re.compile(r"self_attn\.([qkv])_proj\.(weight|bias)")
    _GATE_UP = re.compile(r"mlp\.(gate|up)_proj\.(weight|bias)")
    _EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")

    def _destination(
        self, name: str, params: dict[str, nn.Parameter], source: str | Path | None
    ) -> tuple[str, torch.Tensor] | None:
        """(parameter name, view of it to fill) for an HF tensor name; None = ignore it."""
        if name.endswith("rotary_emb.inv_freq"):
            return None  # some old checkpoints store the rope table; we compute it
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # tied: the embedding is the head (some exports store both)
        match = self._LAYER.fullmatch(name)
        if match is not None:
            prefix = f"model.layers.{match[1]}."
            rest = match[2]
            if m := self._QKV.fullmatch(rest):
                pname = prefix + f"self_attn.qkv_proj.{m[2]}"
                if pname in params:
                    q, kv = self.config.q_size, self.config.kv_size
                    start = {"q": 0, "k": q, "v": q + kv}[m[1]]
                    size = q if m[1] == "q" else kv
                    return pname, params[pname][start : start + size]
            elif m := self._GATE_UP.fullmatch(rest):
                pname = prefix + f"mlp.gate_up_proj.{m[2]}"
                if pname in params:
                    half = params[pname].shape[0] // 2
                    return pname, params[pname][:half] if m[1] == "gate" else params[pname][half:]
            elif m := self._EXPERT.fullmatch(rest):
                expert, kind = int(m[1]), m[2]
                pname = prefix + ("mlp.experts.w2" if kind == "down" else "mlp.experts.w13")
                if pname in params and expert < params[pname].shape[0]:
                    w = params[pname][expert]
                    if kind == "down":
                        return pname, w
                    half = w.shape[0] // 2
                    return pname, w[:half] if kind == "gate" else w[half:]
            elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                # transformers-5 in-memory layout: already stacked [E, 2I, H] / [E, H, I]
                pname = prefix + ("mlp.experts.w13" if rest.endswith("gate_up_proj") else "mlp.experts.w2")
                if pname in params:
                    return pname, params[pname]
        if name in params:
            return name, params[name]
        raise ModelLoadError(
            source,
            f"unexpected weight {name!r} for a {self.config.model_type} model",
        )

    def _hf_names(self, pname: str, seen: set[str]) -> str:
        """The checkpoint names that would fill ``pname`` and were not given."""
        prefix, _, leaf = pname.rpartition(".")
        if self.config.hf_fused_projections:
            return pname
        if prefix.endswith("self_attn.qkv_proj"):
            base = prefix.removesuffix("qkv_proj")
            names = [f"{base}{p}_proj.{leaf}" for p in "qkv"]
        elif prefix.endswith("mlp.gate_up_proj"):
            base = prefix.removesuffix("gate_up_proj")
            names = [f"{base}{p}_proj.{leaf}" for p in ("gate", "up")]
        elif pname.endswith(("mlp.experts.w13", "mlp.experts.w2")):
            base = pname.rsplit(".", 1)[0]
            kinds = ("down",) if leaf == "w2" else ("gate", "up")
            n = self.config.num_experts
            names = [f"{base}.{e}.{k}_proj.weight" for e in range(n) for k in kinds]
        else:
            return pname
        return ", ".join(n for n in names if n not in seen) or pname


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
) -> DecoderForCausalLM:
    """An unloaded model whose parameters are allocated (uninitialised) directly in
    ``dtype`` on ``device``; fill it with :meth:`DecoderForCausalLM.load_weights`."""
    device = torch.device(device)
    with _default_dtype(dtype), device:
        model = DecoderForCausalLM(config, max_positions, device)
    return model.eval()
