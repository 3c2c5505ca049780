"""The fused native per-token kernels against the pure-torch layers they replace."""

from __future__ import annotations

import pytest
import torch
from amx_expected import amx_routes_expected

from travelator import kernels
from travelator.model import kv_layout
from travelator.model.layers import RMSNorm, RotaryEmbedding, gelu_tanh_and_mul, silu_and_mul

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels do not build here")
ops = torch.ops.travelator

# Ulp-level differences only (exp and rsqrt are not torch's): a bf16 value may round the
# other way, one ulp of bf16 is 2**-8 of its size.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (37, 512), (300, 72)])
def test_rms_norm_and_residual(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.data = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), norm(x), **TOL[dtype])
    resid = x.clone()
    out = ops.add_rms_norm_(resid, delta, norm.weight, 1e-5)
    assert torch.equal(resid, x + delta)  # the residual stream, rounded as torch adds
    torch.testing.assert_close(out, norm(x + delta), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 256, 40])  # 40: a partial vector at the end of a head
def test_head_rms_norm_in_place_through_a_view(dtype, head_dim):
    """Qwen3's q/k norm: every head of a [T, H, D] view into a fused QKV row normalised in
    place, against float64 arithmetic (and the torch RMSNorm the torch path runs); the rest of
    the row (here the values) is left as it was."""
    g = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 19, 6, 2
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype)
    weight = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    values_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    x64 = q.double()
    want = weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    norm = RMSNorm(head_dim, 1e-6, dtype)
    norm.weight.data = weight
    torch_layer = norm(q)
    ops.head_rms_norm_(q, weight, 1e-6)
    torch.testing.assert_close(q.double(), want, **TOL[dtype])
    torch.testing.assert_close(q, torch_layer, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], values_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 100: a partial vector at the end of a row; 104: bf16 rows end on one vector of 8 after the 16s
@pytest.mark.parametrize("inter", [1408, 100, 104])
def test_silu_and_mul(dtype, inter):
    gate_up = (torch.randn(33, 2 * inter, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    gate_up[3, 7] = float("nan")
    want = silu_and_mul(gate_up)
    got = ops.silu_and_mul(gate_up)
    assert got[3, 7].isnan() and got.isnan().sum() == 1
    torch.testing.assert_close(got, want, equal_nan=True, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1152, 100, 104, 7])  # 100, 104, 7: partial vectors at the end of a row
def test_gelu_tanh_and_mul(dtype, inter):
    """GeGLU (Gemma): against float64 arithmetic of the tanh formula and the torch layer."""
    gate_up = (torch.randn(33, 2 * inter, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([30.0, -30.0, 0.0])  # saturated both ways, and zero
    gate, up = gate_up.double().chunk(2, dim=-1)
    gelu = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))
    got = ops.gelu_tanh_and_mul(gate_up)
    torch.testing.assert_close(got, gelu_tanh_and_mul(gate_up), **TOL[dtype])
    torch.testing.assert_close(got.double(), (gelu.to(dtype).double() * up), **TOL[dtype])


@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_a_bf16_rows_vector_steps_give_the_scalar_steps_bits(name):
    """A bf16 row's vector steps (on AVX2 16 values at a time, then 8) give, bit for bit, what
    the same values give in rows of 7, too short for a vector."""
    gen = torch.Generator().manual_seed(3)
    gate, up = ((torch.randn(7 * 24, generator=gen) * 4).bfloat16() for _ in range(2))  # 10 x 16 + 8
    gate[5] = float("nan")
    op = getattr(ops, name)
    one_row = op(torch.cat([gate, up]).view(1, -1)).view(-1)
    rows_of_7 = op(torch.cat([gate.view(-1, 7), up.view(-1, 7)], dim=1)).view(-1)
    assert torch.equal(one_row.view(torch.int16), rows_of_7.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 40: half a head is not a whole vector; (32, 24): partial rotary (Phi-4-mini's 0.75 of a head)
@pytest.mark.parametrize("head_dim,rotary", [(64, 64), (40, 40), (32, 24), (128, 96)])
def test_rope(dtype, head_dim, rotary):
    rope = RotaryEmbedding(rotary, 512, 10000.0, None)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(20, 8, head_dim, generator=g).to(dtype)
    k = torch.randn(20, 4, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 512, (20,), generator=g)
    want_q, want_k = rope(positions, q, k)
    # float64: the first rotary numbers turned pair (i, i + rotary / 2) by position * theta^(-2i / rotary)
    angle = positions.double()[:, None] * 10000.0 ** (-torch.arange(0, rotary, 2).double() / rotary)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]

    def exact(x):
        x = x.double()
        a, b, rest = x[..., : rotary // 2], x[..., rotary // 2: rotary], x[..., rotary:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin, rest), dim=-1)

    exact_q, exact_k = exact(q), exact(k)
    ops.rope_(q, k, positions, rope.cos, rope.sin)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    # The float32 tables (as transformers' own) hold angles of up to 512 rad to ~3e-5.
    near = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(q.double(), exact_q, **near)
    torch.testing.assert_close(k.double(), exact_k, **near)


def test_write_kv_puts_each_head_in_its_slot():
    """The native KV write puts token t's head h at [slot // bs, h, slot % bs] (the layout of
    model/kv_layout.py), reading k and v as row-strided views of one fused QKV tensor (as the
    model hands them over)."""
    g = torch.Generator().manual_seed(4)
    tokens, kvh, d, blocks, bs = 37, 4, 64, 20, 16
    qkv = torch.randn(tokens, (8 + 2 * kvh) * d, generator=g).bfloat16()
    k = qkv[:, 8 * d:(8 + kvh) * d].view(tokens, kvh, d)
    v = qkv[:, (8 + kvh) * d:].view(tokens, kvh, d)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    k_cache, v_cache = torch.randn(2, blocks, kvh, bs, d, generator=g).bfloat16().unbind(0)
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        for h in range(kvh):
            want_k[slot // bs, h, slot % bs] = k[t, h]
            want_v[slot // bs, h, slot % bs] = v[t, h]
    torch_k, torch_v = k_cache.clone(), v_cache.clone()
    ops.write_kv_(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # The torch path's writer (the fallback's) puts them there too.
    kv_layout.write_rows(torch_k, slots, k)
    kv_layout.write_rows(torch_v, slots, v)
    assert torch.equal(torch_k, want_k) and torch.equal(torch_v, want_v)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.write_kv_(k_cache, v_cache, torch.tensor([0, blocks * bs]), k[:2], v[:2])
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.write_kv_(k_cache.float(), v_cache.float(), slots, k, v)


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 512, generator=g).bfloat16()
    w = torch.rand(512, generator=g).bfloat16()
    whole = ops.rms_norm(x, w, 1e-5)
    for i in (0, 17, 63):
        assert torch.equal(ops.rms_norm(x[i : i + 1].contiguous(), w, 1e-5), whole[i : i + 1])
    gu = torch.randn(64, 2816, generator=g).bfloat16()
    assert torch.equal(ops.silu_and_mul(gu[5:6].contiguous()), ops.silu_and_mul(gu)[5:6])


def test_rope_rejects_positions_past_the_table():
    rope = RotaryEmbedding(16, 8, 10000.0, None)
    q, k = torch.randn(1, 2, 16), torch.randn(1, 1, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rope_(q, k, torch.tensor([8]), rope.cos, rope.sin)


def test_auto_falls_back_to_torch_without_a_compiler(monkeypatch):
    from travelator.model.ops import TorchOps, make_ops

    def no_compiler():
        raise kernels.NativeKernelsUnavailable("native kernels could not be built: no g++")

    monkeypatch.setattr(kernels, "load", no_compiler)
    kernels.available.cache_clear()
    try:
        ops = make_ops("auto", torch.device("cpu"))
        assert type(ops) is TorchOps and ops.attention_backend == "torch"
        with pytest.raises(kernels.NativeKernelsUnavailable, match="no g.."):
            make_ops("native", torch.device("cpu"))
    finally:
        kernels.available.cache_clear()  # the next caller sees the real build again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 32001, generator=g).to(dtype)
    x[5, 100] = x[5, 7] = 50.0  # a tie: the first index wins
    x[9, :] = 0.0
    x[11, 300] = float("nan")  # a NaN row: the first NaN, as torch
    x[11, 20] = float("nan")
    x[12, 4] = float("inf")
    x[13, 1000:1010] = x[13].max() + 1  # bf16 rounds many values alike: ties are common
    x[14, 32000] = float("nan")  # in the tail past the vectors only
    x[15, :] = -1.0
    x[15, 10], x[15, 3] = 0.0, -0.0  # zeros of both signs tie: the first
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(x), x.float().argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(x[:, :3].contiguous()), x[:, :3].argmax(dim=-1))


@pytest.mark.skipif(not hasattr(ops, "small_m_linear"), reason="needs AVX512-BF16 or AVX2")
@pytest.mark.parametrize("n,k", [(37, 100), (64, 32), (1000, 333), (2048, 1024)])
def test_small_m_linear_against_float64(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    max_rows = ops.small_m_linear_rows()  # 4 on AVX512-BF16 and on AVX2
    x = torch.randn(max_rows, k, generator=g).to(torch.bfloat16)
    ref = x.double() @ w.double().T  # bf16 inputs are exact in float64
    y = ops.small_m_linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (max_rows, n)
    # float32 sums, then one bf16 rounding: within a few bf16 ulps of the exact value.
    torch.testing.assert_close(y.double(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
    # A row's result does not depend on the other rows.
    for rows in range(1, max_rows):
        assert torch.equal(ops.small_m_linear(x[-rows:].contiguous(), w), y[-rows:])
    with pytest.raises(RuntimeError, match=f"1 to {max_rows} rows"):
        ops.small_m_linear(torch.zeros(max_rows + 1, k, dtype=torch.bfloat16), w)


@pytest.mark.skipif(not hasattr(ops, "blocked_linear"), reason="built on AVX512-BF16 CPUs")
@pytest.mark.parametrize("n,k", [(64, 2), (64, 96), (192, 96), (256, 1408), (128, 1030)])
@pytest.mark.parametrize("biased", [False, True])
def test_blocked_linear_against_float64(n, k, biased):
    """blocked_linear over its weight layout: float64's product within bf16 rounding, at row
    counts around its 6-row micro-kernel and past 128, with k over several passes (1408: 64-pair
    passes up to 18 rows, 256-pair ones past) and an odd number of pairs (1030); rows dealt
    out unevenly (7: 4 + 3, 13: 5 + 4 + 4); at 1408, 151 rows are a tile of 138 and one of 13,
    three groups; one block of columns (64), so that with AMX (k = 96) one thread has none;
    a row's result never depends on the other rows."""
    from travelator.model.native_linear import blocked_linear_weight

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if biased else None
    x = torch.randn(151, k, generator=g).to(torch.bfloat16)
    blocked = blocked_linear_weight(w)
    assert blocked.shape == (n // 64, k // 2, 64, 2) and torch.equal(blocked[0, 0, 5], w[5, :2])
    y = ops.blocked_linear(x, blocked, bias)
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert y.dtype == torch.bfloat16 and y.shape == (151, n)
    # float32 sums, then one bf16 rounding: within a few bf16 ulps of the exact value.
    torch.testing.assert_close(y.double(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
    for rows in (1, 5, 6, 7, 13, 18, 19, 64, 139, 150):
        assert torch.equal(ops.blocked_linear(x[-rows:].contiguous(), blocked, bias), y[-rows:])
    assert ops.blocked_linear(x[:0], blocked, bias).shape == (0, n)
    with pytest.raises(RuntimeError, match="columns"):
        ops.blocked_linear(x[:, :-2].contiguous(), blocked, bias)


@pytest.mark.skipif(not hasattr(ops, "blocked_linear"), reason="built on AVX512-BF16 CPUs")
@pytest.mark.parametrize("k", [2048, 2050])
@pytest.mark.parametrize("biased", [False, True])
def test_blocked_linear_over_several_tiles_of_rows(k, biased):
    """A long prefill's rows are taken a tile at a time: at k = 2048, 256 rows on AMX (96 on
    the vdpbf16ps kernel where there is no AMX); k = 2050 is not a multiple of 32, so the
    vdpbf16ps kernel takes it on every CPU, 90 rows a tile. 600 rows end in a partial tile,
    4 blocks of columns give each thread more than one, and each row's result is the same in
    any tile. The bias is as large as the products, so that one left out fails the check."""
    from travelator.model.native_linear import blocked_linear_weight

    g = torch.Generator().manual_seed(k)
    w = torch.randn(256, k, generator=g).to(torch.bfloat16)
    x = torch.randn(600, k, generator=g).to(torch.bfloat16)
    bias = (50 * torch.randn(256, generator=g)).to(torch.bfloat16) if biased else None
    blocked = blocked_linear_weight(w)
    y = ops.blocked_linear(x, blocked, bias)
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    torch.testing.assert_close(y.double(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
    for rows in (1, 33, 91, 257, 599):
        assert torch.equal(ops.blocked_linear(x[-rows:].contiguous(), blocked, bias), y[-rows:])


@pytest.mark.skipif(not hasattr(ops, "blocked_linear"), reason="built on AVX512-BF16 CPUs")
def test_blocked_linear_takes_the_tiles_where_the_build_and_cpu_have_amx():
    """On a CPU with AMX the tiles are built and lent (else every bf16 layer there would fall
    back to the vdpbf16ps kernel or oneDNN without a word)."""
    assert (ops.blocked_linear_amx_k_multiple() == 32) is amx_routes_expected()


@pytest.mark.skipif(not hasattr(ops, "blocked_linear"), reason="built on AVX512-BF16 CPUs")
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
def test_native_linear_takes_blocked_linear_where_built(rows):
    """On these CPUs NativeOps lays bf16 weights with a multiple of 64 outputs out for
    blocked_linear (no oneDNN copy) and its linear() takes it at every row count (a few rows
    too: it streams them faster than small_m_linear), 3-D inputs too, and so does the native
    layer stack (the BLOCKED route); other weights keep oneDNN's packed copy."""
    from travelator.model.linear_route import LinearRoute
    from travelator.model.native_linear import blocked_linear_weight
    from travelator.model.ops import NativeOps
    from travelator.model.run_summary import describe_run

    g = torch.Generator().manual_seed(rows)
    w, odd = torch.randn(192, 96, generator=g).bfloat16(), torch.randn(200, 96, generator=g).bfloat16()
    native = NativeOps()
    native.prepare([w, odd], torch.bfloat16)
    assert native.linear_route(w) is LinearRoute.BLOCKED and native.linear_route(odd) is LinearRoute.ONEDNN_BF16
    x = torch.randn(rows, 96, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    y = native.linear(x, w)
    torch.testing.assert_close(y.double(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
    assert torch.equal(y, ops.blocked_linear(x, blocked_linear_weight(w), None))
    assert torch.equal(native.linear(x.view(1, rows, 96), w), y.view(1, rows, 192))
    assert native.streaming_linear(w, None).route is LinearRoute.BLOCKED
    assert native.streaming_linear(odd, None).route is LinearRoute.ONEDNN_BF16
    # The start-up line says which kernel multiplies them; the BLOCKED ones take every row
    # count, so only the other weight's switch to the GEMM is named.
    words = describe_run(native, [w, odd], torch.bfloat16, torch.bfloat16, torch.device("cpu"))
    tiles = ops.blocked_linear_amx_k_multiple() > 0
    assert "1 blocked bf16 kernel" in words and ("1 blocked bf16 kernel on AMX tiles" in words) is tiles
    assert f"steps of up to {native.streaming_rows(False)} rows stream the bf16 weights" in words
    assert "stream the bf16 weights" not in describe_run(native, [w], torch.bfloat16, torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_bitmask_against_a_plain_loop(dtype):
    """Native and torch masking of the constrained rows agree with a loop over the bits."""
    from travelator.model.ops import TorchOps

    g = torch.Generator().manual_seed(5)
    vocab = 1000  # not a multiple of 32
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    masks = torch.randint(-2**31, 2**31 - 1, (3, 32), generator=g, dtype=torch.int64).to(torch.int32)
    masks[1] = -1  # a row with everything allowed
    rows = torch.tensor([4, 0, 2])
    want = logits.clone()
    for k, r in enumerate(rows.tolist()):
        for j in range(vocab):
            if not (int(masks[k, j // 32]) >> (j % 32)) & 1:
                want[r, j] = float("-inf")
    native = logits.clone()
    ops.apply_token_bitmask_(native, masks, rows)
    fallback = logits.clone()
    TorchOps().apply_token_bitmask(fallback, masks, rows)
    assert torch.equal(native, want) and torch.equal(fallback, want)


@pytest.mark.parametrize("bf16_gemm", [True, False], ids=["bf16 GEMM", "widened to float32"])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("biased", [False, True])
def test_native_bf16_linear_against_float64(bf16_gemm, rows, biased):
    """NativeOps.linear on bf16 weights, by both routes: oneDNN's bf16 GEMM, and the float32
    copies AVX2 machines take (forced here, so that every CPU tests that route too)."""
    from travelator.model.linear_route import LinearRoute
    from travelator.model.ops import NativeOps

    if bf16_gemm and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 GEMM on this CPU")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g).to(torch.bfloat16)
    bias = torch.randn(200, generator=g).to(torch.bfloat16) if biased else None
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    native = NativeOps(bf16_gemm=bf16_gemm)
    native.prepare([w], torch.bfloat16)
    assert native.linear_route(w) is (LinearRoute.ONEDNN_BF16 if bf16_gemm else LinearRoute.ONEDNN_FLOAT32)
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    for _ in range(2):  # the second call reuses what the first made (the widened bias)
        y = native.linear(x, w, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 200)
        # float32 sums, then one bf16 rounding: within a few bf16 ulps of the exact value.
        torch.testing.assert_close(y.double(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("biased", [False, True])
def test_native_float32_linear_is_packed(rows, biased):
    """A float32 weight takes oneDNN's packed float32 GEMM (not F.linear on the natural
    layout, which reorders the weight at every call), with float32's own accuracy, and the
    native layer stack does not stream it (its streaming kernel reads bf16 weights)."""
    from travelator.model.linear_route import LinearRoute
    from travelator.model.ops import NativeOps

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    bias = torch.randn(200, generator=g) if biased else None
    x = torch.randn(rows, 96, generator=g)
    native = NativeOps()
    native.prepare([w], torch.float32)
    assert native.linear_route(w) is LinearRoute.ONEDNN_FLOAT32
    assert native.streaming_linear(w, None) is None
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    y = native.linear(x, w, bias)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
