"""oneDNN-packed bf16 projections (blink/models/packed_linear.py) against plain ``F.linear``,
and the executor with packed weights against the same executor without them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from blink.executor import ModelExecutor
from blink.models import packed_linear
from blink.models.decoder import Linear

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from executor_helpers import build_metadata  # noqa: E402
from helpers_models import VOCAB, make_tiny_model, model_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(
    not packed_linear.packing_available(torch.bfloat16, CPU),
    reason="this CPU/torch has no native oneDNN bf16",
)


def test_packing_is_bf16_on_cpu_only():
    assert not packed_linear.packing_available(torch.float32, CPU)
    assert not packed_linear.packing_available(torch.bfloat16, torch.device("cuda"))
    assert not packed_linear.packing_available(torch.bfloat16, torch.device("meta"))


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(96, 160, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=gen).to(torch.bfloat16))
        if bias:
            layer.bias.copy_(torch.randn(160, generator=gen).to(torch.bfloat16))
    layer = layer.to(torch.bfloat16)
    plain = layer.weight.detach().clone()
    # a strided (non-contiguous) input, as the attention output's reshape can give
    x = torch.randn(rows, 192, generator=gen).to(torch.bfloat16)[:, ::2]
    want = F.linear(x.double(), plain.double(), layer.bias.double() if bias else None)
    layer.pack()
    assert layer.packed and layer.weight.is_mkldnn and layer.weight.shape == (160, 96)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 160)
    # bf16 output rounding only (fp32 accumulation): within 1% of the output scale
    assert (got.double() - want).abs().max() <= 0.01 * want.abs().max()
    if rows > 1:  # oneDNN's own path for plain weights gives the very same bits
        assert torch.equal(got, F.linear(x, plain, layer.bias))


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2 here has tied embeddings
def test_executor_with_packed_weights_gives_the_plain_logits(arch, tiny_root):
    files = model_files(make_tiny_model(arch, tiny_root))
    packed = ModelExecutor(files, dtype=torch.bfloat16, block_size=4, num_blocks=32)
    plain = ModelExecutor(files, dtype=torch.bfloat16, block_size=4, num_blocks=32, pack_weights=False)
    assert packed.packed_weights and not plain.packed_weights
    tied = packed.model.lm_head is None
    assert (packed.model.packed_head is not None) == tied
    assert not packed.model.model.embed_tokens.weight.is_mkldnn  # the lookup stays plain
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (9, 14)]
    for ex in (packed, plain):
        ids, md, last = build_metadata(ex, [(p, 0, [2 * i, 2 * i + 1, 2 * i + 8, 2 * i + 9])
                                           for i, p in enumerate(prompts)])
        ex.result = ex.execute(ids, md, torch.arange(len(ids)))
        ids, md, last = build_metadata(ex, [([5], len(prompts[0]), [0, 1, 8, 9])])
        ex.step = ex.execute(ids, md, last)  # a one-row step (plain: torch's own GEMV)
    scale = plain.result.abs().max()
    assert (packed.result - plain.result).abs().max() <= 0.02 * scale
    assert (packed.step - plain.step).abs().max() <= 0.02 * plain.step.abs().max()
    assert (packed.result.argmax(-1) == plain.result.argmax(-1)).float().mean() >= 0.9


def test_the_matmul_backend_chosen_at_load_is_named_in_one_line(tiny_root, caplog):
    """The projections' back-end (not in ops_for's table: it depends on how each weight was
    loaded) is said once at load, and matches what the load did."""
    files = model_files(make_tiny_model("llama", tiny_root))
    plain = ModelExecutor(files, dtype=torch.float32, block_size=4, num_blocks=32)
    assert plain.model.matmul_backend() == "torch's linear on plain float32 weights"
    bf16 = ModelExecutor(files, dtype=torch.bfloat16, block_size=4, num_blocks=32)
    assert bf16.model.matmul_backend() == ("oneDNN on bfloat16 weights packed at load" if bf16.packed_weights
                                           else "torch's linear on plain bfloat16 weights")


@needs_packing
def test_bf16_decode_row_gives_the_same_bits_alone_and_in_a_batch():
    """On the real SmolLM2 (plain weights fail this: a one-row step took another GEMV), a
    decode row's bf16 logits do not depend on what else is in the step: the packed
    projections and the per-tile attention compute each row on its own."""
    from blink.errors import ModelLoadError
    from blink.loader import resolve_model

    try:
        path = resolve_model("smollm2-135m")
    except ModelLoadError as exc:  # the package is a test dependency; say how to get it
        pytest.skip(str(exc))
    ex = ModelExecutor(path, dtype=torch.bfloat16, num_blocks=16, max_model_len=256)
    prompts = [[100 + 3 * i + j for j in range(n)] for i, n in enumerate((20, 33, 9))]
    tables = [[4 * i + k for k in range(4)] for i in range(3)]
    ids, md, _ = build_metadata(ex, [(p[:-1], 0, t) for p, t in zip(prompts, tables)])
    ex.execute(ids, md, torch.arange(len(ids)))  # fill the cache
    step = [(p[-1:], len(p) - 1, t) for p, t in zip(prompts, tables)]
    ids, md, last = build_metadata(ex, step)
    batched = ex.execute(ids, md, last)
    for row in range(3):
        ids, md, last = build_metadata(ex, [step[row]])
        assert torch.equal(ex.execute(ids, md, last)[0], batched[row]), f"row {row}"


@needs_packing
def test_a_compiled_step_refuses_packed_weights(tiny_root):
    from blink.engine.compiled import CompiledModelPhase

    ex = ModelExecutor(model_files(make_tiny_model("llama", tiny_root)), dtype=torch.bfloat16,
                       block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="pack_weights=False"):
        CompiledModelPhase(ex, None, scheduler_buckets=(1,), max_rows=1, suppress_width=1,
                           max_logit_bias=1)
