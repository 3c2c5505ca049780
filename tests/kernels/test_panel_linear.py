"""panel_linear, the bf16 GEMM of AVX2 machines (float32 sums over bf16 weights laid out in
16-column panels), against a plain float32 loop over k, and the route NativeOps gives it."""

from __future__ import annotations

import pytest
import torch

from travelator import kernels

pytestmark = pytest.mark.skipif(
    not kernels.available() or not hasattr(torch.ops.travelator, "panel_linear"),
    reason="panel_linear is built for AVX2 CPUs without AVX-512 only")
ops = torch.ops.travelator


def sum_k_in_order(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T + bias as one float32 sum per output over k in order, rounded to bf16 once. A
    product of two bf16 numbers is exact in float32, so each step rounds once, as a fused
    multiply-add does."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = acc + x[:, k:k + 1].float() * w[:, k].float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 200])
@pytest.mark.parametrize("biased", [False, True])
def test_panel_linear_is_a_float32_sum_over_k_in_order(rows, biased):
    """Bit for bit, for the streamed row counts (1-4: panels side by side, 7 of them, so that
    a thread's range leaves some over after 4 or 2 at a time on one, two or four threads), row
    counts around the 6-row groups and past a tile of rows, k past a slice (several passes) and
    not a multiple of 8, a bias or not."""
    from travelator.model.native_linear import panel_linear_weight

    g = torch.Generator().manual_seed(rows)
    n, k = 112, 1000
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / 8).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if biased else None
    y = ops.panel_linear(x, panel_linear_weight(w), bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert torch.equal(y, sum_k_in_order(x, w, bias))
    # A row's numbers do not depend on the other rows.
    assert torch.equal(ops.panel_linear(x[-1:].contiguous(), panel_linear_weight(w), bias), y[-1:])


def test_panel_linear_refuses_a_weight_of_another_layout():
    x = torch.randn(3, 64).bfloat16()
    with pytest.raises(RuntimeError, match="panel bf16 weight"):
        ops.panel_linear(x, torch.randn(32, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match="columns"):
        ops.panel_linear(x, torch.randn(2, 32, 16).bfloat16(), None)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_native_linear_takes_panels_without_a_bf16_gemm(batch_invariant):
    """Without a bf16 GEMM (forced here) bf16 weights whose columns divide into panels take
    panel_linear at every row count, 3-D inputs too, and so does the native layer stack (on the
    panels, with the bias); other weights keep the widened oneDNN copy."""
    from travelator.model.linear_route import LinearRoute
    from travelator.model.native_linear import panel_linear_weight
    from travelator.model.ops import NativeOps

    g = torch.Generator().manual_seed(3)
    w, odd = torch.randn(192, 100, generator=g).bfloat16(), torch.randn(200, 100, generator=g).bfloat16()
    bias = torch.randn(192, generator=g).bfloat16()
    native = NativeOps(bf16_gemm=False, batch_invariant=batch_invariant)
    native.prepare([w, odd], torch.bfloat16)
    assert native.linear_route(w) is LinearRoute.PANELS and native.linear_route(odd) is LinearRoute.ONEDNN_FLOAT32
    if not batch_invariant:  # the layer stack's specs follow small_m_linear's switch, off when invariant
        spec = native.streaming_linear(w, bias)
        assert spec.route is LinearRoute.PANELS and spec.b is None and spec.bias is bias
        assert torch.equal(spec.a, panel_linear_weight(w))
    for rows in (1, 3, 17, 64):
        x = torch.randn(rows, 100, generator=g).bfloat16()
        y = native.linear(x, w, bias)
        assert torch.equal(y, ops.panel_linear(x, panel_linear_weight(w), bias))
        ref = x.double() @ w.double().T + bias.double()
        torch.testing.assert_close(y.double(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
        assert torch.equal(native.linear(x.view(1, rows, 100), w, bias), y.view(1, rows, 192))
    if batch_invariant:
        x = torch.randn(9, 100, generator=g).bfloat16()
        assert torch.equal(native.linear(x[:1], w), native.linear(x, w)[:1])
