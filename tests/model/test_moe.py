"""The mixture-of-experts layer (model/moe.py) against a per-token loop written here from the
definition (softmax over all experts, the k largest, renormalised or not, the weighted sum of
those experts' SwiGLU MLPs), on both kernel sets and on quantized experts; that unused experts
are never read; and the parameter counts against transformers'."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hf_models import build_checkpoint, load_reference, mixtral_overrides, qwen3_moe_overrides
from travelator import LLM, kernels
from travelator.model.arch import ModelArch
from travelator.model.moe import SparseMoE
from travelator.model.ops import NativeOps, TorchOps

ARCH = ModelArch("qwen3_moe", 256, 64, 128, 1, 4, 2, 16, num_experts=8, experts_per_token=3,
                 expert_intermediate_size=32, norm_topk_prob=True)
OPS = [TorchOps] + ([NativeOps] if kernels.available() else [])


def layer(arch: ModelArch, ops=TorchOps, seed: int = 0) -> SparseMoE:
    moe = SparseMoE(arch, torch.float32, ops())
    g = torch.Generator().manual_seed(seed)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ops_ = moe.ops
    ops_.prepare([moe.router_weight] + [w for e in moe.experts for w in (e.gate_up_weight, e.down_weight)], torch.float32)
    return moe


def per_token(moe: SparseMoE, x: torch.Tensor, k: int, renormalize: bool) -> torch.Tensor:
    """The definition, one token at a time."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t].double() @ moe.router_weight.double().T, dim=-1)
        top = probs.topk(k)
        weights = top.values / top.values.sum() if renormalize else top.values
        for w, e in zip(weights, top.indices.tolist()):
            expert = moe.experts[e]
            gate, up = (x[t].double() @ expert.gate_up_weight.double().T).chunk(2)
            out[t] += w * ((F.silu(gate) * up) @ expert.down_weight.double().T)
    return out


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("renormalize", [True, False])
def test_layer_matches_the_definition(ops, renormalize):
    arch = replace(ARCH, norm_topk_prob=renormalize)
    moe = layer(arch, ops)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x).double(), per_token(moe, x, 3, renormalize), atol=1e-4, rtol=1e-4)


def test_the_definition_tells_top_k_and_renormalisation_apart():
    """The reference is sharp enough to catch the mutants the layer must not be."""
    moe = layer(ARCH)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    want = per_token(moe, x, 3, True)
    for k, renormalize in ((2, True), (4, True), (3, False)):
        assert (per_token(moe, x, k, renormalize) - want).abs().max() > 1e-2


def test_an_expert_no_token_chose_is_never_read():
    moe = layer(ARCH)
    x = torch.rand(20, 64) + 0.1  # every input positive
    moe.router_weight.data[5] = -10.0  # expert 5 scores far below every other
    moe.experts[5].gate_up_weight.data.fill_(float("nan"))
    moe.experts[5].down_weight.data.fill_(float("nan"))
    out = moe(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), per_token(moe, x, 3, True), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method,kernel_set", [("int8", "torch"), ("int4", "torch"), ("int4", "native")])
def test_quantized_experts(method, kernel_set, tmp_path):
    """quantization= applies to every expert (not the router), and the layer is the model its
    dequantized experts make. (Not int8 on the native kernels where the CPU lacks a bf16 GEMM:
    from 4 rows they round the activations to 8 bits too, W8A8, which tests/model/test_w8a8.py
    measures.)"""
    if kernel_set == "native" and not kernels.available():
        pytest.skip("needs the native kernels")
    from travelator.model.quant import quantized_linear

    path = build_checkpoint(tmp_path, "qwen3_moe", **dict(qwen3_moe_overrides(), moe_intermediate_size=64))
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16, quantization=method,
              quantization_group_size=32, kernels=kernel_set)
    moe = llm.engine.runner.model.layers[0].mlp
    assert isinstance(moe.router_weight, torch.Tensor)
    dequantized = layer(llm.engine.arch)
    dequantized.router_weight = moe.router_weight
    for mine, theirs in zip(dequantized.experts, moe.experts):
        for name in ("gate_up_weight", "down_weight"):
            weight = getattr(theirs, name)
            assert not isinstance(weight, torch.Tensor)
            rows = torch.eye(weight.shape[1])
            setattr(mine, name, torch.nn.Parameter(quantized_linear(rows, weight, None).T.contiguous(), requires_grad=False))
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    want = per_token(dequantized, x, moe.top_k, True)
    torch.testing.assert_close(moe(x).double(), want, atol=1e-3 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_parameter_counts_match_transformers(family, tmp_path):
    overrides = mixtral_overrides() if family == "mixtral" else qwen3_moe_overrides()
    path = build_checkpoint(tmp_path, family, **overrides)
    arch = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=8).engine.arch
    ref = load_reference(path)
    assert arch.num_parameters == sum(p.numel() for p in ref.parameters())
    experts = [m for m in ref.modules() if type(m).__name__.endswith("Experts")]
    per_expert = sum(p.numel() for p in experts[0].parameters()) // arch.num_experts
    unused = len(experts) * (arch.num_experts - arch.experts_per_token) * per_expert
    assert arch.active_parameters == arch.num_parameters - unused


@pytest.mark.skipif(not kernels.available() or not hasattr(torch.ops.travelator, "moe_experts"),
                    reason="needs the native experts kernel (AVX2 or AVX512-BF16)")
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_native_bf16_experts_keep_the_python_bits_at_a_wide_hidden_size(tokens):
    """At hidden 1024 a float32 sum's order shows through bf16's rounding in some outputs (at
    128 it seldom does): the native call's bf16 experts must take the very kernel of the Python
    path (on AVX2 panel_linear, expert by expert, not small_m_linear's tiles)."""
    arch = replace(ARCH, hidden_size=1024, expert_intermediate_size=512, num_experts=16)
    moe = layer(arch, NativeOps)
    for expert in moe.experts:
        for name in ("gate_up_weight", "down_weight"):
            weight = getattr(expert, name).data.to(torch.bfloat16)
            del expert._parameters[name]
            setattr(expert, name, torch.nn.Parameter(weight, requires_grad=False))
    moe.router_weight.data = moe.router_weight.data.to(torch.bfloat16)
    moe.ops.prepare([moe.router_weight] + [w for e in moe.experts for w in (e.gate_up_weight, e.down_weight)], torch.bfloat16)
    stack = moe.expert_stack()
    x = torch.randn(tokens, 1024, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    experts, _ = moe.route(x)
    assert torch.equal(moe.ops.moe_experts(x, experts, stack), moe._grouped(x, experts))


@pytest.mark.skipif(not kernels.available() or not hasattr(torch.ops.travelator, "moe_experts"),
                    reason="needs the native experts kernel (AVX2 or AVX512-BF16)")
@pytest.mark.parametrize("method", [None, "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_native_experts_call_is_the_python_path_bit_for_bit(method, tokens):
    """A step of a few tokens takes one native call (ops.moe_experts): bf16 experts in the fused
    passes, int8/int4 ones expert by expert on their integer kernels; the same bits as the
    expert-by-expert Python path, an unused expert untouched."""
    from travelator.model.quant import quantize

    arch = replace(ARCH, hidden_size=128, expert_intermediate_size=96, num_experts=16)  # 64-row chunks + a rest
    moe = layer(arch, NativeOps)
    for expert in moe.experts:
        for name in ("gate_up_weight", "down_weight"):
            weight = getattr(expert, name).data.to(torch.bfloat16)
            del expert._parameters[name]
            setattr(expert, name, torch.nn.Parameter(weight, requires_grad=False) if method is None
                    else quantize(weight, method, 32))
    moe.router_weight.data = moe.router_weight.data.to(torch.bfloat16)
    moe.ops.prepare([moe.router_weight] + [w for e in moe.experts for w in (e.gate_up_weight, e.down_weight)], torch.bfloat16)
    stack = moe.expert_stack()
    assert stack is not None
    rows = min(tokens, *(moe.ops.streaming_rows(*kind) for kind in stack.row_kinds))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    experts, _ = moe.route(x)
    native = moe.ops.moe_experts(x, experts, stack)
    assert native is not None
    assert torch.equal(native, moe._grouped(x, experts))
    unused = sorted(set(range(arch.num_experts)) - set(experts.flatten().tolist()))[0]
    poisoned = moe.experts[unused].down_weight
    {None: lambda: poisoned.data, "int8": lambda: poisoned.scales, "int4": lambda: poisoned.scales_zeros}[method]().fill_(float("nan"))
    assert torch.equal(moe.ops.moe_experts(x, experts, stack), native)
    # Expert parallelism: pairs of another rank's experts (id -1) come out as zero rows.
    here = experts % 2 == 0
    placed = moe.ops.moe_experts(x, torch.where(here, experts, -1), stack)
    assert torch.equal(placed, torch.where(here.flatten()[:, None], native, 0))


class TwoRanks:
    """Rank ``rank`` of two under expert parallelism, its all-reduce left to the test."""

    size = 2
    expert_parallel = True

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def expert_rank(self, expert: int) -> int:
        return expert % self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_placed_experts_on_two_ranks_add_up_to_the_layer(ops, tokens):
    """Each rank holds every other expert whole and runs their pairs only (the native call for
    a few tokens, the grouped path for many); the two ranks' outputs add up to the layer's."""
    arch = replace(ARCH, hidden_size=128, expert_intermediate_size=96)
    full = layer(arch, ops)
    for p in full.parameters():
        p.data = p.data.to(torch.bfloat16)
    linear = lambda m: [m.router_weight] + [w for e in m.held_experts() for w in (e.gate_up_weight, e.down_weight)]  # noqa: E731
    full.ops.prepare(linear(full), torch.bfloat16)
    x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    total = torch.zeros(tokens, 128)
    for rank in (0, 1):
        moe = SparseMoE(arch, torch.bfloat16, ops(), TwoRanks(rank))
        held = [e for e in moe.experts if e.gate_up_weight.numel()]
        assert len(held) == arch.num_experts // 2
        moe.router_weight.data.copy_(full.router_weight.data)
        for e in range(rank, arch.num_experts, 2):
            for name in ("gate_up_weight", "down_weight"):
                setattr(moe.experts[e], name, torch.nn.Parameter(getattr(full.experts[e], name).data.clone(),
                                                                  requires_grad=False))
        moe.ops.prepare(linear(moe), torch.bfloat16)
        total += moe(x).float()
    want = full(x).float()
    torch.testing.assert_close(total, want, atol=0.02 * float(want.abs().max()), rtol=0)


class SplitRank:
    """Rank ``rank`` of two under tensor parallelism: each expert split, not placed."""

    size = 2
    expert_parallel = False

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.skipif(not kernels.available() or not hasattr(torch.ops.travelator, "moe_experts"),
                    reason="needs the native experts kernel (AVX2 or AVX512-BF16)")
@pytest.mark.parametrize("rank", [0, 1])
def test_native_experts_call_adds_a_split_experts_down_bias_on_rank_0_only(rank):
    """Biased experts split over two ranks: the down bias is added once, by rank 0, before the
    all-reduce; the native call must leave it out on rank 1 as the Python path does."""
    arch = replace(ARCH, hidden_size=128, expert_intermediate_size=128, expert_bias=True)  # 64 a rank: every route streams it
    moe = SparseMoE(arch, torch.bfloat16, NativeOps(), SplitRank(rank))
    g = torch.Generator().manual_seed(6)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    moe.ops.prepare([moe.router_weight] + [w for e in moe.experts for w in (e.gate_up_weight, e.down_weight)],
                    torch.bfloat16)
    stack = moe.expert_stack()
    if stack is None:
        pytest.skip("these kernels stream no biased bf16 layer")
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    experts, _ = moe.route(x)
    grouped = moe._grouped(x, experts)
    assert torch.equal(moe.ops.moe_experts(x, experts, stack), grouped)


@pytest.mark.skipif(not kernels.available() or not hasattr(torch.ops.travelator, "moe_experts"),
                    reason="needs the native experts kernel (AVX2 or AVX512-BF16)")
def test_native_experts_call_over_many_rows_keeps_each_tokens_numbers():
    """Past a tile's rows the native call streams an expert's rows in slices: each token's output
    is the one it gets alone (its sums never depend on who else chose its expert), and close to
    the GEMM path's."""
    moe = layer(replace(ARCH, hidden_size=128, expert_intermediate_size=96), NativeOps)
    for p in moe.parameters():
        p.data = p.data.to(torch.bfloat16)
    moe.ops.prepare([moe.router_weight] + [w for e in moe.experts for w in (e.gate_up_weight, e.down_weight)], torch.bfloat16)
    stack = moe.expert_stack()
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    experts, _ = moe.route(x)
    assert int(torch.bincount(experts.flatten()).max()) > moe.ops.streaming_rows(False)
    together = moe.ops.moe_experts(x, experts, stack).view(40, 3, -1)
    for t in (0, 17, 39):
        alone = moe.ops.moe_experts(x[t:t + 1], experts[t:t + 1], stack).view(3, -1)
        assert torch.equal(together[t], alone)
    gemm = moe._grouped(x, experts).view(40, 3, -1)
    torch.testing.assert_close(together.float(), gemm.float(), atol=0.05 * float(gemm.abs().max()), rtol=0)
