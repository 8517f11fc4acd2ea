"""The ``avx512_vnni`` build's int8 activations (x rounded per row and group of 32, llama.cpp's
Q8_0) keep the real SmolLM2-135M-Instruct's predictions: teacher-forced over a fixed English
text, its next-token logits against an fp32 executor's on the same dequantized weights
(benchmarks/bench_int8_quality.py measures the full text and the other builds).

The bounds, measured on the first 128 tokens (this file) and the whole text (361 tokens,
the benchmark), all against fp32:

==============================  ===========  =======  ===================
                                top-1 agree  mean KL  largest flip margin
==============================  ===========  =======  ===================
avx512 (bf16 x)                 0.992        9.1e-4   0.09
avx512_vnni (int8 x, bf16)      0.961        3.8e-3   0.24
  (361 tokens)                  0.956        3.4e-3   0.24
int8 x in fp32, m on sum(qx)    0.992        2.7e-3   0.08
broken: x per row, not group    0.906        4.0e-2   0.52
broken: int6 x per group        0.867        4.4e-2   0.85
broken: x truncated             0.945        1.4e-2   0.12
broken: int4 x per group        0.56         0.63     -
==============================  ===========  =======  ===================

(flip margin: fp32's logit lead of its top-1 where the executor's top-1 differs.) The build
multiplies each group's minimum m (Q4_1, K-quants) by the sum of the rounded x, as llama.cpp's
Q8_1 does, so x's rounding errors meet the whole, centred weight ``d q + m``; with m on the
exact sum(x) (the build's first version) they met ``d q`` alone (0..15 d): 0.945 / 1.7e-2 here.
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.bench_int8_quality import TEXT, compare, int8_activations, make_executor, plain, teacher_forced_logits
from blink.kernels.cpu import quant_linear as cpu_quant_linear

N_TOKENS, CHUNK = 128, 32
# Bounds between the int8 build (0.961, 3.8e-3, 0.24) and a kernel that rounds x wrongly
# (per row: 0.906, 4.0e-2; 6-bit: 0.867, 4.4e-2; truncated: 0.945, 1.4e-2; a wrong code, scale
# or sum: far worse; m on the exact sum(x): 0.945, 1.7e-2). A flip of a prediction fp32 makes by
# more than 1 logit is no rounding noise at all.
MIN_AGREEMENT, MAX_MEAN_KL, MAX_FLIP_MARGIN = 0.95, 6e-3, 1.0

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not all(f in cpu_quant_linear.cpu_flags() for f in cpu_quant_linear.VARIANTS["avx512_vnni"][1]),
                       reason="this CPU cannot run the avx512_vnni build"),
]


@pytest.fixture(scope="module")
def files():
    from blink.errors import ModelLoadError
    from blink.loader import open_model, resolve_model

    try:
        return open_model(resolve_model("smollm2-135m"))
    except ModelLoadError as exc:  # the package is a test dependency; say how to get it
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def ids(files):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(files.tokenizer_json).encode(TEXT, add_special_tokens=False).ids[:N_TOKENS]


@pytest.fixture(scope="module")
def fp32(files, ids):
    """The reference executor and its logits."""
    ex = make_executor(files, "float32", len(ids), CHUNK)
    return ex, teacher_forced_logits(ex, ids, CHUNK)


def within_bounds(ref: torch.Tensor, got: torch.Tensor, ids: list[int]) -> list[str]:
    """The bounds ``got`` misses against ``ref`` (empty: none)."""
    c = compare(ref, got, ids)
    misses = []
    if c.agreement < MIN_AGREEMENT:
        misses.append(f"top-1 agreement {c.agreement:.3f} < {MIN_AGREEMENT}")
    if c.mean_kl > MAX_MEAN_KL:
        misses.append(f"mean KL {c.mean_kl:.2e} > {MAX_MEAN_KL}")
    if c.flip_margins and c.flip_margins[-1] > MAX_FLIP_MARGIN:
        misses.append(f"a prediction fp32 makes by {c.flip_margins[-1]:.2f} logits flipped")
    return misses


def test_the_int8_build_keeps_the_real_models_predictions(files, ids, fp32):
    try:
        ex = make_executor(files, "avx512_vnni", len(ids), CHUNK)
    except ValueError as exc:  # e.g. no oneDNN bf16 here: the 4-bit path rides on the packed one
        pytest.skip(str(exc))
    assert {kernel for kernel, _ in ex.int4_kernels} == {"avx512_vnni"}
    assert sum(ex.int4_kernels.values()) == 4 * ex.config.num_hidden_layers + 1  # the Q8_0 head too
    got = teacher_forced_logits(ex, ids, CHUNK)
    assert not within_bounds(fp32[1], got, ids)
    assert compare(fp32[1], got, ids).mean_kl > 0  # (x was rounded: not the fp32 logits)


@pytest.mark.parametrize("broken", ["per row", "6-bit", "truncated"])
def test_the_bounds_catch_a_kernel_that_rounds_x_wrongly(files, ids, fp32, broken):
    """The C kernel cannot be broken from here: the same check on fp32 with x rounded as a
    faulty kernel would (one scale for the whole row instead of per group of 32, 31 levels
    instead of 127, or x truncated instead of rounded) must miss the bounds, while the right
    rounding meets them."""
    def rounded(levels: int, per_row: bool, to=torch.round):
        def quantize(x: torch.Tensor) -> torch.Tensor:
            group = x.shape[-1] if per_row else 32
            g = x.float().reshape(*x.shape[:-1], -1, group)
            step = g.abs().amax(-1, keepdim=True) / levels
            return (to(g / torch.where(step > 0, step, 1)) * step).reshape(x.shape)
        return quantize

    ex, ref = fp32
    try:
        right = teacher_forced_logits(int8_activations(ex, quantize=rounded(127, False)), ids, CHUNK)
        faulty = {"per row": rounded(127, True), "6-bit": rounded(31, False),
                  "truncated": rounded(127, False, to=torch.trunc)}[broken]
        wrong = teacher_forced_logits(int8_activations(ex, quantize=faulty), ids, CHUNK)
    finally:
        plain(ex)
    assert not within_bounds(ref, right, ids)
    assert within_bounds(ref, wrong, ids)
    assert torch.equal(teacher_forced_logits(ex, ids, CHUNK), ref)  # (the fixture's executor is plain again)
