"""The W8A8 kernel (``csrc/quant_w8a8.cpp``): int8 weights times x quantized per row to int8.

The kernel against a float64 reference of the same quantized math, written out here again
(x's integer form in float32 as the kernel makes it, then the exact integer sums and the
scales in float64), so the only differences left are the kernel's float32 steps and the
output's rounding; the integer sums at their largest (where a saturating instruction would
show); the routes that take it and the rows that stay on the weight-only kernel; a row's
independence from its batch; and a whole model's next-token distributions against bf16.
"""

from __future__ import annotations

import pytest
import torch
from paths import STORIES, STORIES_EXPECTED, needs_stories
from test_quantization import compare, sequence_logprobs

from travelator import LLM
from travelator.model.quant import W8A8_MAX_IN, W8A8_ROWS, quantize


def _ops(batch_invariant: bool = False):
    from travelator import kernels
    from travelator.model.ops import NativeOps

    if not kernels.available() or not hasattr(torch.ops.travelator, "quant_linear_w8a8"):
        pytest.skip("the W8A8 kernel (AVX2) does not build here")
    return NativeOps(batch_invariant=batch_invariant, bf16_gemm=False)  # the CPUs it is on for


def _x_integer_form(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, xs) per row: xq = round(x * (127 / max |x|)) in float32 (to nearest even), clamped
    to +-127; xs = max |x| / 127 in float32. A zero row: xq 0, xs 0."""
    xf = x.float()
    top = xf.abs().amax(dim=1, keepdim=True)
    inv = torch.where(top > 0, torch.full_like(top, 127) / top, torch.zeros_like(top))  # not 127 / top: a reciprocal
    xq = torch.round(xf * inv).clamp(-127, 127)
    return xq, (top / 127)[:, 0]


def reference(x: torch.Tensor, q, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, scale of its terms) in float64: y = (xq . q) xs[m] scale[n] (+ bias[n]), the sums exact."""
    xq, xs = _x_integer_form(x)
    acc = xq.double() @ q.codes().double().T  # integers below 2^53: exact
    y = acc * xs.double()[:, None] * q.scales[: q.out_features].double()
    size = y.abs()
    if bias is not None:
        y, size = y + bias.double(), size + bias.double().abs()
    return y, size


def _weight(n: int, k: int, seed: int):
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02, "int8")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("biased", [False, True])
# rows: every microkernel tail (4, 3, 2, 1 rows) and several chunks of 64; K: padded blocks of
# x (200, 129) and a whole one; N: partial tiles and panels, and a single output.
@pytest.mark.parametrize("rows,k,n", [(1, 200, 136), (2, 128, 1), (3, 129, 65), (5, 1024, 64), (7, 384, 200),
                                      (64, 256, 100), (130, 200, 130), (300, 129, 72)])
def test_the_kernel_is_the_quantized_math(rows, k, n, biased, dtype):
    """To float32 rounding of its three float steps (float32 x), or to the output's own bf16
    rounding (half a unit in the last of 8 bits, 2^-9 of a value: 4e-3 leaves room for the
    float32 steps before it)."""
    _ops()
    g = torch.Generator().manual_seed(rows * 1000 + k)
    q = _weight(n, k, seed=n + k)
    x = torch.randn(rows, k, generator=g)
    x[:, k // 3] *= 20  # an outlier in every row, as real activations have
    x = x.to(dtype)
    bias = torch.randn(n, generator=g) if biased else None
    got = torch.ops.travelator.quant_linear_w8a8(x, q.packed, q.scales, bias, n)
    assert got.dtype == dtype and got.shape == (rows, n)
    ref, size = reference(x, q, bias)
    rtol = 4e-3 if dtype == torch.bfloat16 else 1e-6
    err = (got.double() - ref).abs()
    assert (err <= rtol * size + 1e-30).all(), err.max().item()


def test_the_integer_sums_at_their_largest_are_exact():
    """x of magnitude 1 is +-127 in its integer form, weights of one magnitude are codes +-127,
    so every product is +-127 * 127 and row 0 (all +1) against output 0 (all +) sums 4096 of
    the largest: pairs of 2 * 127 * 127 in vpmaddubsw's int16 (a u8 weight of q + 128, up to
    255, would saturate there) and a sum past 2^24, where float32 rounds. Exact to float32."""
    _ops()
    g = torch.Generator().manual_seed(5)
    k = 4096
    signs = lambda *shape: torch.randint(0, 2, shape, generator=g).float() * 2 - 1  # noqa: E731
    w = signs(72, k) * 0.02
    w[0], w[1] = 0.02, -0.02
    x = signs(5, k)
    x[0] = 1.0
    q = quantize(w, "int8")
    assert set(q.codes().unique().tolist()) == {-127, 127}
    got = torch.ops.travelator.quant_linear_w8a8(x, q.packed, q.scales, None, 72)
    ref, size = reference(x, q, None)
    assert abs(ref[0, 0].item() - k * 0.02) < 1e-6 * k  # the largest sum, its true value
    assert ((got.double() - ref).abs() <= 1e-6 * size).all()


def test_nan_and_infinity_stay_in_their_row_and_a_zero_row_is_its_bias():
    _ops()
    g = torch.Generator().manual_seed(9)
    q = _weight(70, 256, seed=3)
    bias = torch.randn(70, generator=g)
    x = torch.randn(6, 256, generator=g)
    x[1, 3], x[2, 100], x[3] = float("nan"), float("inf"), 0.0
    got = torch.ops.travelator.quant_linear_w8a8(x, q.packed, q.scales, bias, 70)
    assert torch.isnan(got[1]).all() and torch.isnan(got[2]).all()
    assert torch.equal(got[3], bias)
    keep = [0, 4, 5]
    ref, size = reference(x[keep], q, bias)
    assert ((got[keep].double() - ref).abs() <= 1e-6 * size).all()


def test_the_route_takes_w8a8_from_its_rows_and_the_weight_only_kernel_below():
    """ops.linear: W8A8_ROWS rows and more are the W8A8 kernel's bits (bias, 3-D x); fewer
    rows are quant_linear_int8's; the native layer stack stops where W8A8 starts."""
    ops = _ops()
    assert ops.w8a8_rows == W8A8_ROWS > 1
    assert ops.streaming_rows(True, int8=True) == W8A8_ROWS - 1
    assert ops.streaming_rows(True) == ops.quant_kernel_rows  # int4 keeps its kernel's rows
    q = _weight(136, 200, seed=1)
    bias = torch.randn(136, generator=torch.Generator().manual_seed(2)).bfloat16()
    for rows in (1, W8A8_ROWS - 1, W8A8_ROWS, 40):
        x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = ops.linear(x, q, bias)
        if rows >= W8A8_ROWS:
            want = torch.ops.travelator.quant_linear_w8a8(x, q.packed, q.scales, bias.float(), 136)
        else:
            want = torch.ops.travelator.quant_linear_int8(x, q.packed, q.scales, 136) + bias
        assert torch.equal(got, want), rows
    x3 = torch.randn(2, 5, 200, generator=torch.Generator().manual_seed(7))
    assert torch.equal(ops.linear(x3, q), ops.linear(x3.reshape(10, 200), q).reshape(2, 5, 136))


def test_a_layer_too_wide_for_its_int32_sums_keeps_the_weight_only_kernel():
    """Past W8A8_MAX_IN inputs K * 127 * 127 could overflow int32: the kernel refuses such a
    weight, and the route leaves it to the weight-only kernel (blocks of 128 inputs)."""
    ops = _ops()
    q = _weight(1, W8A8_MAX_IN + 1, seed=6)
    x = torch.randn(W8A8_ROWS, W8A8_MAX_IN + 1, generator=torch.Generator().manual_seed(6)).bfloat16()
    with pytest.raises(RuntimeError, match="overflow"):
        torch.ops.travelator.quant_linear_w8a8(x, q.packed, q.scales, None, 1)
    assert torch.equal(ops.linear(x, q), torch.ops.travelator.quant_linear_int8(x, q.packed, q.scales, 1))


def test_a_row_does_not_depend_on_its_batch():
    """Per-row scales, exact integer sums and per-element float steps: a row alone, among 39
    others, or among 299 (other chunks and threads) gives the same bits. Batch-invariant mode
    takes W8A8 at every row count, so one row and many take the same kernel."""
    ops = _ops(batch_invariant=True)
    assert ops.w8a8_rows == 1 and ops.streaming_rows(True, int8=True) == 0
    q = _weight(200, 256, seed=4)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    many, some = ops.linear(x, q), ops.linear(x[:40], q)
    for i in (0, 17, 39):
        assert torch.equal(ops.linear(x[i:i + 1], q), some[i:i + 1])
        assert torch.equal(many[i:i + 1], some[i:i + 1])


@needs_stories
def test_stories260k_w8a8_stays_close_to_bf16():
    """Next-token distributions over three stories, the model in bf16 against the same with
    int8 weights, each story run as one prefill (every layer past W8A8_ROWS rows: W8A8), and with
    the weight-only kernels for comparison. Per-token int8 activations add about one more
    int8 rounding per product to the weights' own (x's step is 1/254 of its row's largest
    |x|), so W8A8's error is of the order of int8 weights' alone (measured: mean KL 0.0018 nats,
    top-1 0.97 over 130 positions; weight-only int8 0.0009, 0.99). Bounded at 0.01 nats and
    0.9: room for other builds' rounding, tighter than int4's bounds (0.05, 0.85) in
    test_quantization.py, and far below what a broken kernel gives."""
    base = LLM(str(STORIES), device="cpu", dtype="bfloat16", quantization="none")
    texts = [STORIES_EXPECTED, "Tom had a red car. He liked to drive it to the park with his mom and dad.",
             "The little bird sat on the tree. It was sad because it could not fly. A kind girl came by."]
    ids = [base.tokenizer.encode(t) for t in texts]
    ref = torch.cat([sequence_logprobs(base, i) for i in ids])
    llm = LLM(str(STORIES), device="cpu", dtype="bfloat16", quantization="int8")
    ops = llm.engine.runner.model.ops
    if not getattr(ops, "w8a8_rows", 0):
        pytest.skip("W8A8 is not on here (a bf16 GEMM, or no native build)")
    kl, top1 = compare(ref, torch.cat([sequence_logprobs(llm, i) for i in ids]))
    rows = ops.w8a8_rows
    ops.w8a8_rows = 0  # the weight-only kernel and the dequantizing path
    kl_w8, top1_w8 = compare(ref, torch.cat([sequence_logprobs(llm, i) for i in ids]))
    ops.w8a8_rows = rows
    print(f"stories260K bf16 vs W8A8: mean KL {kl:.5f} nats, top-1 agreement {top1:.3f}; weight-only int8: "
          f"{kl_w8:.5f}, {top1_w8:.3f}; {ref.shape[0]} positions of {len(texts)} texts")
    assert kl <= 0.01 and top1 >= 0.9, (kl, top1)
