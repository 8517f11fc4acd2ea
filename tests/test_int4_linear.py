"""The int4 path for small steps (blink.models.int4_linear): a GGUF file's Q4_0/Q4_1 codes
unpacked exactly, the int4 kernel against its reference, and the model using the codes
only where every row of a projection has them and only for steps of few tokens."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from blink.executor import ModelExecutor
from blink.loader import open_model
from blink.loader.gguf_weights import unpack_q4
from blink.kernels.cpu import q4_linear as cpu_q4_linear, quant_linear as cpu_quant_linear
from blink.models import int4_linear

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from executor_helpers import build_metadata  # noqa: E402
from quant_weights import MACHINE_BUILDS  # noqa: E402
from helpers_models import make_tiny_model  # noqa: E402
from test_loader_gguf import export_to_gguf  # noqa: E402

needs_kernel = pytest.mark.skipif(not int4_linear.available(torch.bfloat16, torch.device("cpu")),
                                  reason="no 4-bit CPU kernel runs here")
needs_torch_kernel = pytest.mark.skipif(not int4_linear._torch_kernel_runs(),
                                        reason="torch's int4 CPU kernel does not run here")
needs_amx_kernel = pytest.mark.skipif(not cpu_q4_linear.available(),
                                      reason="the AMX kernel does not run here (no AMX, compiler or permission)")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_unpacked_codes_are_the_values_gguf_dequantizes(qtype):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((24, 96)).astype(np.float32) * rng.uniform(0.1, 3, (24, 1)).astype(np.float32)
    data = gguf.quants.quantize(weight, qtype)
    want = gguf.quants.dequantize(data, qtype).reshape(24, 96)
    q4 = unpack_q4(data, qtype.name, 24, 96)
    assert q4.codes.dtype == torch.uint8 and int(q4.codes.max()) <= 15
    got = int4_linear.dequantize(q4.codes, q4.scale, q4.zero).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kernel", [pytest.param("torch", marks=needs_torch_kernel),
                                    pytest.param("amx", marks=needs_amx_kernel)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_kernel_matches_its_reference(rows, kernel):
    torch.manual_seed(0)
    n, k = 96, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    # as a GGUF file's: fp16 d and m, zero = m + 8d (the AMX kernel keeps d and m so)
    scale, m = (torch.rand(n, k // 32) * 0.02).half().float(), (torch.randn(n, k // 32) * 0.05).half().float()
    zero = m + 8 * scale
    bias = torch.randn(n).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    weight = int4_linear.pack(codes, scale, zero, kernel=kernel)
    assert weight.kernel == kernel
    got = int4_linear.linear(x, weight, bias).float()
    want = int4_linear.reference_linear(x, codes, scale, zero, bias).float()
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # a wrong code would move an output by ~scale * |x| >> the tolerance: the test can fail
    wrong = codes.clone()
    wrong[0] ^= 1
    assert (int4_linear.reference_linear(x, wrong, scale, zero, bias).float() - got).abs().max() > 5e-2


def test_pack_refuses_a_shape_without_whole_groups():
    with pytest.raises(ValueError, match="groups of 32"):
        int4_linear.pack(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 1))


def _decode_logits(ex: ModelExecutor, rows: int) -> torch.Tensor:
    """Prefill ``rows`` prompts, then one decode token each; the decode logits."""
    prompts = [([3 + 5 * r + j for j in range(6)], 0, [r]) for r in range(rows)]
    ex.execute(*build_metadata(ex, prompts))
    return ex.execute(*build_metadata(ex, [([7 + r], 6, [r]) for r in range(rows)]))


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    return export_to_gguf(make_tiny_model("llama", root), root / "llama-q4_1.gguf", Q.Q4_1)


def _check_steps_on_the_codes(q4_gguf, rows: list[int], kernel_env: str | None, monkeypatch,
                              exact_weights_up_to: int, times_bf16: float = 3):
    """Steps of ``rows`` tokens on the 4-bit copies are as close to the fp32 logits (on the same
    dequantized values) as bf16 is (``times_bf16`` its error); those of at most ``exact_weights_up_to`` rows differ from
    the bf16 copy's (the kernel multiplies other weights than its bf16 rounding). Returns the
    executors."""
    files = open_model(q4_gguf)
    fp32 = ModelExecutor(files, dtype=torch.float32, num_blocks=64, max_model_len=64)
    kw = dict(dtype=torch.bfloat16, num_blocks=64, max_model_len=64)
    if kernel_env is not None:
        monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, kernel_env)
    cpu_quant_linear.reset()  # (the AMX kernel's choice too)
    try:
        with_int4 = ModelExecutor(files, int4_decode=True, **kw)
    finally:
        monkeypatch.delenv(cpu_q4_linear.IMPL_ENV, raising=False)
        cpu_quant_linear.reset()
    plain = ModelExecutor(files, int4_decode=False, **kw)
    if not with_int4.packed_weights:
        pytest.skip("no native oneDNN bf16 on this CPU (the int4 path rides on the packed one)")
    layers = fp32.config.num_hidden_layers
    assert not fp32.config.tie_word_embeddings  # the head is a projection of its own
    # every projection and the head are Q4_1 in this export
    assert with_int4.int4_projections == (4 * layers + 1, 4 * layers + 1)
    assert sum(with_int4.int4_kernels.values()) == 4 * layers + 1
    assert plain.int4_projections == (0, 0)
    for n in rows:
        for ex in (fp32, with_int4, plain):
            ex.kv_caches = [(k.zero_(), v.zero_()) for k, v in ex.kv_caches]
        ref, a, b = (_decode_logits(ex, n) for ex in (fp32, with_int4, plain))
        if n <= exact_weights_up_to:
            assert not torch.equal(a, b), n  # the int4 path ran
        err_int4, err_bf16 = (a - ref).abs().max().item(), (b - ref).abs().max().item()
        assert err_int4 < max(times_bf16 * err_bf16, 0.05), (n, err_int4, err_bf16)
    return with_int4, plain


@needs_torch_kernel
def test_torch_kernel_runs_small_steps_on_the_codes_and_large_ones_on_bf16(q4_gguf, monkeypatch):
    with_int4, plain = _check_steps_on_the_codes(q4_gguf, [1, int4_linear.TORCH_MAX_ROWS], "torch", monkeypatch,
                                                 exact_weights_up_to=int4_linear.TORCH_MAX_ROWS)
    assert set(with_int4.int4_kernels) == {("torch", int4_linear.TORCH_MAX_ROWS)}
    big = int4_linear.TORCH_MAX_ROWS + 1  # more tokens: the bf16 copy, bit for bit
    for ex in (with_int4, plain):
        ex.kv_caches = [(k.zero_(), v.zero_()) for k, v in ex.kv_caches]
    assert torch.equal(_decode_logits(with_int4, big), _decode_logits(plain, big))


@pytest.mark.parametrize("build", MACHINE_BUILDS)
def test_the_kernel_without_amx_runs_small_steps_on_the_codes_and_large_ones_on_bf16(q4_gguf, monkeypatch, build):
    """``$BLINK_CPU_Q4=avx512|avx2``: what a CPU without AMX runs, whatever this one has; the
    int8 builds where oneDNN's bf16 product runs on AMX (K-quants on a CPU with AMX)."""
    if not all(f in cpu_quant_linear.cpu_flags() for f in cpu_quant_linear.VARIANTS[build][1]):
        pytest.skip(f"this CPU cannot run the {build} build")
    monkeypatch.setattr(int4_linear, "onednn_amx", lambda: True)
    top = int4_linear.native_max_rows(build)
    int8 = build in cpu_quant_linear.INT8_BUILDS
    assert top == (int4_linear.INT8_MAX_ROWS_BESIDE_AMX if int8 else int4_linear.NATIVE_MAX_ROWS[build])
    with_int4, plain = _check_steps_on_the_codes(q4_gguf, [1, 3, top], build, monkeypatch, exact_weights_up_to=top,
                                                 times_bf16=12 if int8 else 3)
    assert set(with_int4.int4_kernels) == {(build, top)}
    for ex in (with_int4, plain):  # more tokens: the bf16 copy, bit for bit
        ex.kv_caches = [(k.zero_(), v.zero_()) for k, v in ex.kv_caches]
    assert torch.equal(_decode_logits(with_int4, top + 1), _decode_logits(plain, top + 1))


@pytest.mark.parametrize("build", sorted(cpu_quant_linear.INT8_BUILDS & set(MACHINE_BUILDS)))
def test_the_int8_builds_run_every_step_on_the_codes_without_a_bf16_copy(q4_gguf, monkeypatch, build):
    """``$BLINK_CPU_Q4=avx512_vnni|avx2_vnni|avx2_int8``: x quantized to int8 per group of 32 (llama.cpp's Q8_0
    activations), every step on the codes, prefills too, and no bf16 copy kept. Its logits
    are further from the fp32 forward's than bf16's: a group's int8 step is max|x| / 127
    where bf16's is |x| / 128 (tests/test_cpu_quant_linear.py holds the kernel to the exact
    product of its quantized x)."""
    if not all(f in cpu_quant_linear.cpu_flags() for f in cpu_quant_linear.VARIANTS[build][1]):
        pytest.skip(f"this CPU cannot run the {build} build")
    monkeypatch.setattr(int4_linear, "onednn_amx", lambda: False)  # a CPU without AMX
    with_int4, plain = _check_steps_on_the_codes(q4_gguf, [1, 3, 40], build, monkeypatch,
                                                 exact_weights_up_to=40, times_bf16=12)
    assert set(with_int4.int4_kernels) == {(build, None)}
    for layer in with_int4.model.model.layers:  # the bf16 copies were dropped, not packed
        assert layer.self_attn.qkv_proj.weight.numel() == 0 and layer.mlp.down_proj.weight.numel() == 0
    assert with_int4.model.lm_head.weight.numel() == 0


@needs_amx_kernel
def test_amx_kernel_runs_every_step_on_the_codes_without_a_bf16_copy(q4_gguf, monkeypatch):
    few = cpu_q4_linear.few_rows()
    # beyond `few` rows the kernel multiplies the bf16 rounding of the file's weights, as the
    # bf16 copy does (here to the same bits: the tiny model's sums are short)
    with_int4, plain = _check_steps_on_the_codes(q4_gguf, [1, few, few + 1, 40], None, monkeypatch,
                                                 exact_weights_up_to=few)
    assert set(with_int4.int4_kernels) == {("amx", None)}
    for layer in with_int4.model.model.layers:  # the bf16 copies were dropped, not packed
        assert layer.self_attn.qkv_proj.weight.numel() == 0 and layer.mlp.down_proj.weight.numel() == 0
    assert with_int4.model.lm_head.weight.numel() == 0
    assert plain.model.model.layers[0].mlp.down_proj.weight.numel() > 0


@needs_kernel
def test_a_fused_projection_with_one_part_in_another_format_stays_bf16(q4_gguf):
    """As in a Q4_K_M-style mix, where some parts of a fused projection are not Q4_0/Q4_1."""
    files = open_model(q4_gguf)
    ex = ModelExecutor(files, dtype=torch.bfloat16, num_blocks=32, max_model_len=64, pack_weights=False)
    without_v0 = ((name, q4) for name, q4 in files.iter_q4_codes()
                  if name != "model.layers.0.self_attn.v_proj.weight")
    given, total = ex.model.use_int4_weights(without_v0)
    layers = ex.model.model.layers
    assert layers[0].self_attn.qkv_proj.int4 is None  # q and k alone are not the whole weight
    assert layers[0].mlp.gate_up_proj.int4 is not None and layers[1].self_attn.qkv_proj.int4 is not None
    assert (given, total) == (4 * len(layers), 4 * len(layers) + 1)  # the head is Q4_1 too


@needs_kernel
def test_a_tied_head_stored_as_q4_gets_its_int4_copy(tmp_path):
    files = open_model(make_tiny_model("qwen2", tmp_path))  # tied embeddings
    ex = ModelExecutor(files, dtype=torch.bfloat16, num_blocks=32, max_model_len=64, pack_weights=False)
    model = ex.model
    assert model.lm_head is None
    embed = model.model.embed_tokens.weight.float()
    data = gguf.quants.quantize(embed.numpy(), Q.Q4_0)
    q4 = unpack_q4(data, "Q4_0", *embed.shape)
    assert model.use_int4_weights([("model.embed_tokens.weight", q4)]) == (1, 4 * len(model.model.layers) + 1)
    hidden = torch.randn(2, embed.shape[1]).bfloat16()
    want = int4_linear.reference_linear(hidden, q4.codes, q4.scale, q4.zero, None).float()
    torch.testing.assert_close(model.compute_logits(hidden).float(), want, rtol=2e-2, atol=2e-2)
    if model.int4_head.max_rows is not None:  # torch's kernel: larger steps on the embedding
        many = torch.randn(model.int4_head.max_rows + 1, embed.shape[1]).bfloat16()
        assert torch.equal(model.compute_logits(many), torch.nn.functional.linear(many, model.model.embed_tokens.weight))


@pytest.mark.parametrize("build", ["avx512", "avx2"])
def test_k_quants_mixed_in_fused_projections_and_a_tied_head_run_on_their_codes(tmp_path, monkeypatch, build):
    """A Q4_K_M-style mix: Q4_K q/k/gate/up beside a Q6_K v and down and a Q6_K tied head (as
    QuantCodes hold them). Each fused projection is one copy on the codes, parts in their own
    formats; a decode step's logits are the fp32 product on the file's weights (within the
    bf16 forward's own error), a large step's those of the bf16 copy, bit for bit."""
    from blink.loader.gguf_weights import QuantCodes

    if not all(f in cpu_quant_linear.cpu_flags() for f in cpu_quant_linear.VARIANTS[build][1]):
        pytest.skip(f"this CPU cannot run the {build} build")
    monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, build)
    cpu_quant_linear.reset()
    try:
        files = open_model(make_tiny_model("qwen2", tmp_path))  # tied embeddings
        kw = dict(num_blocks=64, max_model_len=64, pack_weights=False)
        ex = ModelExecutor(files, dtype=torch.bfloat16, **kw)
        if not packed_available():
            pytest.skip("no native oneDNN bf16 on this CPU")
        fp32 = ModelExecutor(files, dtype=torch.float32, **kw)
        gen = torch.Generator().manual_seed(0)
        tensors = []
        for name, tensor in files.iter_tensors(torch.float32, progress=False):
            if tensor.dim() != 2 or (tensor.shape[0] % 16) or tensor.shape[1] % 32:
                continue
            n, k = tensor.shape
            six = any(part in name for part in ("v_proj", "down_proj", "embed_tokens"))
            scale = tensor.abs().amax(dim=1, keepdim=True).clamp_min(1e-3)
            if six:  # Q6_K: int8 q - 32, d per 16
                codes = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
                d = (scale / 32).expand(n, k // 16).contiguous()
                q = QuantCodes("Q6_K", codes, d, None, 16, 8)
            else:  # Q4_K: 0..15, d and m per 32, fp32 (not fp16) values
                codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
                d = (scale / 8 * (1 + 1e-4 * torch.rand(n, k // 32, generator=gen))).contiguous()
                q = QuantCodes("Q4_K", codes, d, -8 * d, 32, 4)
            tensors.append((name, q))
        for model in (ex.model, fp32.model):  # both hold the codes' values
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, q in tensors:
                    pname, dst = model._destination(name, params, model.config.source or None)
                    dst.copy_(q.dequantize().to(dst.dtype))
        plain = ModelExecutor(files, dtype=torch.bfloat16, **kw)
        plain.model.load_state_dict(ex.model.state_dict())
        given, total = ex.model.use_int4_weights(tensors)
        assert given == total  # every projection and the head
        layer = ex.model.model.layers[0]
        assert [p.bits for p in layer.self_attn.qkv_proj.int4.parts] == [4, 6]  # Q6_K's codes in 6 bits
        assert len(layer.mlp.gate_up_proj.int4.parts) == 1 and ex.model.int4_head.kernel == build
        for e in (ex, plain):
            e.model.use_packed_weights()
        rows = 3
        ref, a, b = (_decode_logits(e, rows) for e in (fp32, ex, plain))
        assert not torch.equal(a, b)  # the codes ran
        err_codes, err_bf16 = (a - ref).abs().max().item(), (b - ref).abs().max().item()
        assert err_codes < max(3 * err_bf16, 0.05), (err_codes, err_bf16)
        big = int4_linear.NATIVE_MAX_ROWS[build] + 1
        for e in (ex, plain):
            e.kv_caches = [(k.zero_(), v.zero_()) for k, v in e.kv_caches]
        assert torch.equal(_decode_logits(ex, big), _decode_logits(plain, big))
    finally:
        monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
        cpu_quant_linear.reset()


def packed_available() -> bool:
    from blink.models import packed_linear

    return packed_linear.packing_available(torch.bfloat16, torch.device("cpu"))


@pytest.fixture(scope="module")
def k_quant_ggufs(tmp_path_factory):
    """A llama-shaped model (hidden 256: whole K-quant super-blocks) written as GGUF files whose
    2-D weights are Q4_K, Q5_K or Q6_K (the head too), random blocks as the file holds them
    (gguf's Python package quantizes no K-quant: the blocks are random bytes, fp16 fields finite)."""
    import transformers as tf

    from test_cpu_quant_linear import random_blocks
    from test_loader_gguf import export_to_gguf

    root = tmp_path_factory.mktemp("kquants")
    config = tf.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                            tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(root / "hf", safe_serialization=True)
    original = gguf.quants.quantize
    files = {}
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        qtype = Q[name]

        def quantize(array, q, qtype=qtype):
            if q != qtype:
                return original(array, q)
            rows, cols = array.shape
            return random_blocks(qtype, rows, cols, seed=rows + cols)

        gguf.quants.quantize = quantize
        try:
            files[name] = export_to_gguf(root / "hf", root / f"llama-{name.lower()}.gguf", qtype)
        finally:
            gguf.quants.quantize = original
    return files


def test_uncoded_matrices_name_the_products_no_kernel_takes_on_codes(k_quant_ggufs, tmp_path):
    """What --dtype auto asks on a CPU without native bf16 (blink.engine.engine._codes_kernel): a
    file whose every product the kernels take on codes (K-quant projections and head; the F32
    embedding is a lookup, the head being its own tensor) has none; the same model in F32 names
    every projection and the head; an HF directory has no codes at all (None)."""
    assert open_model(k_quant_ggufs["Q4_K"]).uncoded_matrices() == []
    hf = k_quant_ggufs["Q4_K"].parent / "hf"
    uncoded = open_model(export_to_gguf(hf, tmp_path / "f32.gguf", Q.F32)).uncoded_matrices()
    assert "model.layers.0.self_attn.q_proj.weight" in uncoded and "lm_head.weight" in uncoded
    assert "model.embed_tokens.weight" not in uncoded and not any("norm" in name for name in uncoded)
    assert open_model(hf).uncoded_matrices() is None


def test_reading_and_packing_a_gguf_s_codes_show_progress(k_quant_ggufs, capfd):
    """The codes' unpacking and packing (seconds at 1B, before the "Loading weights" bar)
    show progress bars of their own on stderr; ``progress=False`` shows none."""
    files = open_model(k_quant_ggufs["Q4_K"])
    list(files.iter_quant_codes(progress=False))
    assert "Reading quantized codes" not in capfd.readouterr().err
    ex = ModelExecutor(files, dtype=torch.bfloat16, num_blocks=64, max_model_len=64)
    err = capfd.readouterr().err
    assert "Reading quantized codes" in err and "Loading weights" in err
    if ex.int4_projections[0]:  # (a CPU whose kernels take the codes)
        assert "Packing codes for the CPU kernels" in err


@pytest.mark.parametrize("build", MACHINE_BUILDS)
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_a_k_quant_gguf_runs_on_its_codes(k_quant_ggufs, monkeypatch, build, name):
    """The file's K-quant codes, q/k rows un-permuted as iter_tensors un-permutes the weights,
    are gguf's values bit for bit, and every projection and the head run on them: a decode
    step's logits are the fp32 forward's on the same weights within the bf16 forward's error."""
    if not all(f in cpu_quant_linear.cpu_flags() for f in cpu_quant_linear.VARIANTS[build][1]):
        pytest.skip(f"this CPU cannot run the {build} build")
    files = open_model(k_quant_ggufs[name])
    dense = dict(files.iter_tensors(torch.float32, progress=False))
    coded = dict(files.iter_quant_codes())
    assert coded and all(codes.qtype == name for codes in coded.values())
    for hf_name, codes in coded.items():
        assert torch.equal(codes.dequantize(), dense[hf_name]), hf_name
    monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, build)
    cpu_quant_linear.reset()
    try:
        kw = dict(num_blocks=64, max_model_len=64)
        ex = ModelExecutor(files, dtype=torch.bfloat16, **kw)
        if not ex.packed_weights:
            pytest.skip("no native oneDNN bf16 on this CPU")
        layers = ex.config.num_hidden_layers
        assert ex.int4_projections == (4 * layers + 1, 4 * layers + 1)
        assert ex.int4_kernels == {(build, int4_linear.native_max_rows(build)): 4 * layers + 1}
        # on the file's own scales (F_K) and codes (Q5_K in 5 bits, Q6_K in 6), the same weights
        parts = [p for m in ex.model.modules() if getattr(m, "int4", None) is not None for p in m.int4.parts]
        assert len(parts) == 4 * layers + 1 and all(p.format & cpu_quant_linear.F_K for p in parts)  # + the head
        assert {p.bits for p in parts} == {{"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[name]}
        qkv = ex.model.model.layers[1].self_attn.qkv_proj.int4.parts
        want = torch.cat([dense[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(torch.cat([cpu_quant_linear.dequantize(p) for p in qkv], dim=0), want)
        fp32 = ModelExecutor(files, dtype=torch.float32, **kw)
        plain = ModelExecutor(files, dtype=torch.bfloat16, int4_decode=False, **kw)
        ref, a, b = (_decode_logits(e, 3) for e in (fp32, ex, plain))
        assert not torch.equal(a, b)
        err_codes, err_bf16 = (a - ref).abs().max().item(), (b - ref).abs().max().item()
        # the int8 builds round x per super-block of 256 channels on these files (llama.cpp's Q8_K:
        # activation_group): on this random model 0.9-3.1x the bf16 forward's error (per 32:
        # 1.4-2.0x); the float builds 0.6-1.2x
        bound = 4 if build in cpu_quant_linear.INT8_BUILDS else 3
        assert err_codes < max(bound * err_bf16, 0.05), (err_codes, err_bf16)
    finally:
        monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
        cpu_quant_linear.reset()


@pytest.mark.parametrize("build", ["avx2_vnni", "avx2_int8", "avx2"])
def test_without_onednn_bf16_the_avx2_kernels_still_run_the_codes(q4_gguf, monkeypatch, build):
    """An AVX2 CPU under --dtype bfloat16 packs no bf16 weights (oneDNN has no native bf16
    there): the int8 build runs every step on the codes, and no bf16 copy is kept; the fp32 one
    decode-sized steps, larger ones on the plain bf16 weights."""
    from blink.models import packed_linear

    if not all(f in cpu_quant_linear.cpu_flags() for f in cpu_quant_linear.VARIANTS[build][1]):
        pytest.skip(f"this CPU cannot run the {build} build")
    monkeypatch.setattr(packed_linear, "packing_available", lambda dtype, device: False)
    monkeypatch.setattr(int4_linear, "onednn_amx", lambda: False)  # as on an AVX2 CPU
    monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, build)
    cpu_quant_linear.reset()
    int8 = build in cpu_quant_linear.INT8_BUILDS
    try:
        files = open_model(q4_gguf)
        kw = dict(dtype=torch.bfloat16, num_blocks=64, max_model_len=64)
        ex, plain = ModelExecutor(files, **kw), ModelExecutor(files, int4_decode=False, **kw)
        top = None if int8 else 8
        assert not ex.packed_weights and ex.int4_kernels == {(build, top): sum(ex.int4_kernels.values())}
        assert ex.int4_projections[0] == ex.int4_projections[1] > 0
        fp32 = ModelExecutor(files, dtype=torch.float32, num_blocks=64, max_model_len=64)
        ref, a, b = (_decode_logits(e, 3) for e in (fp32, ex, plain))
        assert not torch.equal(a, b)
        assert (a - ref).abs().max().item() < max((12 if int8 else 3) * (b - ref).abs().max().item(), 0.05)
        for e in (ex, plain):
            e.kv_caches = [(k.zero_(), v.zero_()) for k, v in e.kv_caches]
        big_a, big_b = _decode_logits(ex, 9), _decode_logits(plain, 9)
        if int8:  # every step on the codes: no bf16 copy kept
            assert not torch.equal(big_a, big_b)
            assert ex.model.model.layers[0].mlp.down_proj.weight.numel() == 0
        else:  # beyond 8 rows: bf16
            assert torch.equal(big_a, big_b)
    finally:
        monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
        cpu_quant_linear.reset()


def test_onednn_on_amx_follows_the_cpu_and_the_switches(monkeypatch):
    """Whether the int8 build leaves large steps to the bf16 copy: only where oneDNN's bf16
    product can run on AMX (``$BLINK_CPU_AMX=0`` or ``$ONEDNN_MAX_CPU_ISA`` below AMX: not)."""
    from blink.kernels.cpu import onednn_amx

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("BLINK_CPU_AMX", raising=False)
    here = onednn_amx()
    assert here == (here and "amx_bf16" in cpu_quant_linear.cpu_flags())  # never without the CPU's flag
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not onednn_amx() and int4_linear.native_max_rows("avx512_vnni") is None
    assert int4_linear.native_max_rows("avx2_int8") is None
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert onednn_amx() == here
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("BLINK_CPU_AMX", "0")
    assert not onednn_amx()


@pytest.mark.parametrize("build", sorted(cpu_quant_linear.INT8_BUILDS & set(MACHINE_BUILDS)))
def test_projections_every_step_runs_on_their_codes_are_never_dequantized(q4_gguf, monkeypatch, build):
    """Where every step runs on a projection's codes (an int8 build), its bf16 weight is never
    read: loading skips dequantizing and copying it, with the same logits as loading it and
    dropping it after, and the norms and the embedding still loaded."""
    from blink.loader.gguf_weights import GGUFWeights
    from blink.models.decoder import DecoderForCausalLM

    if not all(f in cpu_quant_linear.cpu_flags() for f in cpu_quant_linear.VARIANTS[build][1]):
        pytest.skip(f"this CPU cannot run the {build} build")
    monkeypatch.setattr(int4_linear, "onednn_amx", lambda: False)  # a CPU without AMX
    monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, build)
    cpu_quant_linear.reset()
    read: list[str] = []
    dequantize = GGUFWeights._dequantize

    def spy(self, index, *args):
        read.append(self.reader.tensors[index].name)
        return dequantize(self, index, *args)

    monkeypatch.setattr(GGUFWeights, "_dequantize", spy)
    kw = dict(dtype=torch.bfloat16, num_blocks=64, max_model_len=64)
    try:
        skipping = ModelExecutor(open_model(q4_gguf), **kw)
        if not skipping.packed_weights:
            pytest.skip("no native oneDNN bf16 on this CPU")
        skipped_read, read[:] = list(read), []
        monkeypatch.setattr(DecoderForCausalLM, "unread_plain_weights", lambda self: set())
        loading = ModelExecutor(open_model(q4_gguf), **kw)
    finally:
        monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
        cpu_quant_linear.reset()
    layers = skipping.config.num_hidden_layers
    assert skipping.int4_projections == (4 * layers + 1, 4 * layers + 1)
    # 7 projection tensors a layer and the head are Q4_1; the embedding and the norms are read
    assert len(read) - len(skipped_read) == 7 * layers + 1
    assert "token_embd.weight" in skipped_read and "output_norm.weight" in skipped_read
    assert not any(name.startswith(("blk.0.attn_q", "blk.0.ffn_down", "output.weight")) for name in skipped_read)
    assert torch.equal(_decode_logits(skipping, 3), _decode_logits(loading, 3))


def test_loading_checks_but_does_not_copy_a_tensor_for_an_unread_weight(tmp_path):
    """``load_weights(unread=...)``: such a parameter counts as filled, a tensor given for it
    is not copied, a missing other one is still an error."""
    from blink.errors import ModelLoadError

    files = open_model(make_tiny_model("llama", tmp_path))
    ex = ModelExecutor(files, dtype=torch.float32, num_blocks=8, max_model_len=32, pack_weights=False)
    model = ex.model
    down = "model.layers.0.mlp.down_proj.weight"
    assert model.parameter_of(down) == down and model.parameter_of("model.layers.0.self_attn.k_proj.weight") \
        == "model.layers.0.self_attn.qkv_proj.weight"
    before = model.get_parameter(down).detach().clone()
    tensors = dict(files.iter_tensors(torch.float32, progress=False))
    model.load_weights(((n, t + 1 if n == down else t) for n, t in tensors.items()), unread={down})
    assert torch.equal(model.get_parameter(down), before)  # checked, not copied
    model.load_weights(((n, t) for n, t in tensors.items() if n != down), unread={down})
    with pytest.raises(ModelLoadError, match="missing weight"):
        model.load_weights(((n, t) for n, t in tensors.items() if n != down))


def test_adopting_loads_take_whole_tensors_and_copy_parts(tmp_path):
    """``load_weights(adopt=True)``: a whole parameter of the tensor's dtype is the tensor itself
    (no copy); a fused parameter's parts, and a tensor of another dtype, are copied."""
    files = open_model(make_tiny_model("llama", tmp_path))
    ex = ModelExecutor(files, dtype=torch.float32, num_blocks=8, max_model_len=32, pack_weights=False)
    model = ex.model
    tensors = {n: t.clone() for n, t in files.iter_tensors(torch.float32, progress=False)}
    model.load_weights(tensors.items(), adopt=True)
    down, q = "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    assert model.get_parameter(down).data_ptr() == tensors[down].data_ptr()
    qkv = model.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
    assert qkv.data_ptr() != tensors[q].data_ptr() and torch.equal(qkv[: tensors[q].shape[0]], tensors[q])
    model.load_weights(((n, t.double()) for n, t in tensors.items()), adopt=True)  # another dtype: copied
    assert model.get_parameter(down).dtype == torch.float32 and torch.equal(model.get_parameter(down), tensors[down])
    fresh = {n: t.clone() for n, t in tensors.items()}
    model.load_weights(fresh.items())  # not adopting: copies (into the adopted memory)
    assert model.get_parameter(down).data_ptr() == tensors[down].data_ptr() != fresh[down].data_ptr()
