"""The Q8_0 head for small steps (blink.kernels.cpu_q8_matmul, DecoderForCausalLM.use_q8_head):
a GGUF file's Q8_0 codes unpacked exactly (the real SmolLM2 embedding too), the C kernel
against its reference, the fallbacks, and the executor taking logits from the codes only
for steps of few rows, only when it measured them faster, and never with --int4-decode off."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from blink.executor import ModelExecutor
from blink.kernels import cpu_q8_matmul
from blink.loader import open_model
from blink.loader.gguf_weights import unpack_q8_0
from blink.models import decoder

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from helpers_models import make_tiny_model  # noqa: E402
from test_loader_gguf import export_to_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def kernel_builds():
    """This machine has a C compiler (CI's too): the kernel must build, not fall back."""
    assert cpu_q8_matmul.kernel() is not None


def _dequantized(codes: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    n, k = codes.shape
    return (codes.float().view(n, k // 32, 32) * scale.unsqueeze(-1)).view(n, k).numpy()


def test_unpacked_codes_are_the_values_gguf_dequantizes():
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((40, 96)).astype(np.float32) * rng.uniform(0.1, 3, (40, 1)).astype(np.float32)
    data = gguf.quants.quantize(weight, Q.Q8_0)
    q8 = unpack_q8_0(data, 40, 96)
    assert q8.codes.dtype == torch.int8 and q8.scale.shape == (40, 3)
    np.testing.assert_array_equal(_dequantized(q8.codes, q8.scale),
                                  gguf.quants.dequantize(data, Q.Q8_0).reshape(40, 96))


def test_the_real_smollm2_embedding_codes_are_its_values():
    files = open_model("smollm2-135m")
    q8 = files.q8_codes("model.embed_tokens.weight")
    assert q8 is not None and tuple(q8.codes.shape) == (49152, 576)
    weights = files._weights
    index = next(e.tensor_index for e in weights._entries if e.hf_name == "model.embed_tokens.weight")
    tensor = weights.reader.tensors[index]
    rows = slice(1000, 1064)  # a slice: the whole table in fp32 is 113 MB
    want = gguf.quants.dequantize(np.asarray(tensor.data)[rows], tensor.tensor_type)
    np.testing.assert_array_equal(_dequantized(q8.codes[rows], q8.scale[rows]), want.reshape(64, 576))
    assert files.q8_codes("model.layers.0.mlp.down_proj.weight") is None  # Q4_1 in this file


@pytest.mark.parametrize("rows", [1, 3, 4, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_its_reference(rows, threads):
    g = torch.Generator().manual_seed(rows)
    n, k = 4096, 576  # 2.4M weights: enough for the kernel to start a second thread
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.01
    wide = torch.randn(rows, k + 64, generator=g).to(torch.bfloat16)
    x = wide[:, :k]  # rows strided, as a view hands them over
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_q8_matmul.q8_matmul(x, codes, scale)
    finally:
        torch.set_num_threads(previous)
    want = cpu_q8_matmul.reference(x, codes, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    wrong = codes.clone()
    wrong[5] = -wrong[5]  # a wrong code moves an output far beyond the tolerance: the test can fail
    assert (cpu_q8_matmul.reference(x, wrong, scale).float() - got.float()).abs()[:, 5].max() > 0.05


def test_what_the_kernel_does_not_take_runs_the_reference(monkeypatch, tmp_path, caplog):
    g = torch.Generator().manual_seed(9)
    codes = torch.randint(-127, 128, (64, 64), dtype=torch.int8, generator=g)
    scale = torch.rand(64, 2, generator=g)
    for x in (torch.randn(2, 64, generator=g), torch.randn(17, 64, generator=g).to(torch.bfloat16)):
        assert torch.equal(cpu_q8_matmul.q8_matmul(x, codes, scale), cpu_q8_matmul.reference(x, codes, scale))
    monkeypatch.setattr(cpu_q8_matmul, "_kernel", [])
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level("WARNING", logger="blink.kernels"):
        assert cpu_q8_matmul.kernel() is None and cpu_q8_matmul.kernel() is None
    assert sum("Q8_0 matmul" in r.getMessage() for r in caplog.records) == 1
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(cpu_q8_matmul.q8_matmul(x, codes, scale), cpu_q8_matmul.reference(x, codes, scale))


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("q8")
    return export_to_gguf(make_tiny_model("llama", root), root / "llama-q8_0.gguf", Q.Q8_0)


@pytest.mark.parametrize("faster", [True, False])
def test_executor_takes_few_rows_logits_from_the_codes_when_faster(q8_gguf, monkeypatch, faster):
    monkeypatch.setattr(decoder.DecoderForCausalLM, "_q8_head_is_faster", lambda *a: faster)
    files = open_model(q8_gguf)
    kw = dict(dtype=torch.bfloat16, num_blocks=32, max_model_len=64)
    ex = ModelExecutor(files, **kw)
    if not ex.packed_weights:
        pytest.skip("no native oneDNN bf16 on this CPU (the Q8_0 head rides on the packed path)")
    off = ModelExecutor(files, int4_decode=False, **kw)
    assert ex.q8_head is faster and off.q8_head is False
    model = ex.model
    assert model.lm_head is not None  # untied: the head is lm_head.weight, stored as Q8_0
    hidden = torch.randn(decoder.Q8_HEAD_MAX_ROWS, ex.config.hidden_size).to(torch.bfloat16)
    q8 = files.q8_codes("lm_head.weight")
    from_codes = cpu_q8_matmul.reference(hidden, q8.codes, q8.scale)
    calls = []
    real = cpu_q8_matmul.q8_matmul
    monkeypatch.setattr(cpu_q8_matmul, "q8_matmul", lambda *a: calls.append(1) or real(*a))
    if faster:
        torch.testing.assert_close(model.compute_logits(hidden).float(), from_codes.float(), rtol=2**-7, atol=1e-3)
        assert calls == [1]
    else:
        assert torch.equal(model.compute_logits(hidden), off.model.compute_logits(hidden))
    many = torch.randn(decoder.Q8_HEAD_MAX_ROWS + 1, ex.config.hidden_size).to(torch.bfloat16)
    assert torch.equal(model.compute_logits(many), off.model.compute_logits(many))  # the bf16 head
    assert len(calls) == int(faster)
