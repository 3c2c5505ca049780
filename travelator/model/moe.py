"""A mixture of experts in place of the gated MLP (Mixtral, Qwen3-MoE, gpt-oss), for one flat
batch of tokens [T, hidden].

The router scores every expert per token (a linear layer, then a float32 softmax); each token
takes its ``experts_per_token`` largest, renormalised where the config says so. The experts
then run as grouped work: the step's (token, expert) pairs are sorted by expert and each expert
used by the step multiplies all of its rows at once through ``ops.linear`` (so every weight
format and route of the dense layers serves experts too); an expert no token chose is never
read. Each pair's output lands in its own row, and a token's outputs are summed in the order
of its own top-k, in float32: a token's numbers never depend on which others share the step
(batch invariance), given linear kernels whose rows are independent.

A step of a few tokens runs the experts in one native call instead (``ops.moe_experts``,
csrc/moe_experts.cpp: each projection by the streaming route ops.linear would take, bf16
experts in one parallel pass per projection), with the same numbers: a decode of one request
would otherwise spend more time between its kernels than in them.

Tensor parallelism splits every expert's intermediate size over the ranks like the dense MLP
(gate/up by rows, down by columns), with one all-reduce of the layer's output; or, with expert
parallelism, places whole experts on ranks (``TPGroup.expert_rank``): each rank runs the pairs
of the experts it holds (another rank's pairs are zero rows) and the same all-reduce adds the
ranks' weighted sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from travelator.model.arch import ModelArch
from travelator.model.blocks import param
from travelator.model.native_linear import StreamingLinears
from travelator.model.ops import TorchOps
from travelator.model.tp_group import TPGroup


class Expert(nn.Module):
    """One expert: a SwiGLU MLP of the experts' intermediate size (this rank's share); gpt-oss's
    with biases (the down projection's added on rank 0 only, before the all-reduce)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        self.gate_up_weight = param(2 * inter, hidden, dtype=dtype)
        self.down_weight = param(hidden, inter, dtype=dtype)
        self.gate_up_bias = param(2 * inter, dtype=dtype) if bias else None
        self.down_bias = param(hidden, dtype=dtype) if bias else None


# An expert's (weight, bias) for its gate/up projection, then for its down projection.
ExpertProjections = tuple[tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]


# Rows of one expert up to which bf16 experts stream through the native call rather than the GEMM
# library (docs/benchmarks.md: the MoE rows).
EXPERT_STREAMING_ROWS = 64


@dataclass(frozen=True, slots=True)
class ExpertStack:
    """Expert e's gate/up and down projections as linear layers 2e and 2e + 1, each three
    entries of ``linear_tensors`` (a, b, bias) and of ``linear_ints`` (route, group, out
    features): the encoding of model/layer_stack.py, read by csrc/moe_experts.cpp."""

    linear_tensors: list[torch.Tensor | None]
    linear_ints: list[int]
    row_kinds: frozenset[tuple[bool, bool, bool]]  # (quantized, int8, blocked) of its weights, as streaming_rows takes them

    @staticmethod
    def of(ops: TorchOps, experts: list[ExpertProjections]) -> ExpertStack | None:
        """The experts' encoding, each expert's projections as this rank applies them
        (SparseMoE.projections)."""
        linears = StreamingLinears()
        for projections in experts:
            for weight, bias in projections:
                spec = ops.streaming_linear(weight, bias)
                if spec is None:
                    return None
                linears.append(spec)
        return ExpertStack(linears.tensors, linears.ints, frozenset(linears.row_kinds))

    def covers(self, ops: TorchOps, rows: int) -> bool:
        """Whether the native call serves a step whose busiest expert has ``rows`` rows: bf16
        experts stream (small_m_linear's tiles in slices of the rows they take, or on AVX2
        panel_linear, expert by expert) up to
        EXPERT_STREAMING_ROWS rows, where the GEMM library's cost per call outweighs
        re-reading an expert's weights from cache; int8/int4 ones up to their integer kernels'
        rows (ops.streaming_rows)."""
        return all(rows <= (ops.streaming_rows(q, int8) if q else EXPERT_STREAMING_ROWS * bool(ops.streaming_rows(q)))
                   for q, int8, _ in self.row_kinds)


class SparseMoE(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, ops: TorchOps, tp: TPGroup | None = None) -> None:
        super().__init__()
        placed = tp is not None and tp.expert_parallel
        self.ops = ops
        self.tp = tp
        self.top_k = arch.experts_per_token
        self.renormalize = arch.norm_topk_prob
        self.router_weight = param(arch.num_experts, arch.hidden_size, dtype=dtype)
        self.router_bias = param(arch.num_experts, dtype=dtype) if arch.expert_bias else None
        # The experts this rank holds (all of them, each its share, unless they are placed).
        held = [e for e in range(arch.num_experts) if not placed or tp.expert_rank(e) == tp.rank]
        self._held = torch.zeros(arch.num_experts, dtype=torch.bool)
        self._held[held] = True
        # Where they stand among the held ones (the native call's expert ids); -1: another rank's.
        self._local_id = torch.full((arch.num_experts,), -1, dtype=torch.long)
        self._local_id[held] = torch.arange(len(held))
        inter = arch.expert_intermediate_size // (tp.size if tp is not None and not placed else 1)
        self.experts = nn.ModuleList(Expert(arch.hidden_size, inter, dtype, arch.expert_bias) if self._held[e]
                                     else Expert(0, 0, dtype, arch.expert_bias)  # empty: another rank's
                                     for e in range(arch.num_experts))
        # A split expert's down bias is added once, by rank 0; a placed one's by its rank.
        self._adds_down_bias = placed or tp is None or tp.rank == 0
        limit, alpha = arch.swiglu_limit, arch.swiglu_alpha
        self.act = ops.silu_and_mul if limit is None else (lambda h: ops.clamped_swiglu(h, alpha, limit))
        self._stack: ExpertStack | None = None
        self._stack_gathered = False

    def held_experts(self) -> list[Expert]:
        """The experts whose weights this rank holds."""
        return [e for e, held in zip(self.experts, self._held.tolist()) if held]

    def projections(self, expert: Expert) -> ExpertProjections:
        """The expert's projections as this rank applies them: a split expert's down bias on
        rank 0 only (the all-reduce sums the ranks' shares), a placed one's on its rank."""
        down_bias = expert.down_bias if self._adds_down_bias else None
        return (expert.gate_up_weight, expert.gate_up_bias), (expert.down_weight, down_bias)

    def expert_stack(self) -> ExpertStack | None:
        """The held experts' projections as the native experts call takes them (gathered at
        the first call: the weights are final then), or None where it cannot run them."""
        if not self._stack_gathered:
            silu = self.act == self.ops.silu_and_mul
            self._stack = ExpertStack.of(self.ops, [self.projections(e) for e in self.held_experts()]) if silu else None
            self._stack_gathered = True
        return self._stack

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] (largest score first) and their weights [T, k], rounded
        to the model dtype as the reference rounds them."""
        logits = self.ops.linear(x, self.router_weight, self.router_bias)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, hidden = x.shape
        experts, weights = self.route(x)
        stack = self.expert_stack()
        out = None
        if stack is not None and stack.covers(self.ops, int(torch.bincount(experts.flatten()).max())):
            out = self.ops.moe_experts(x, self._local_id[experts], stack)
        if out is None:
            out = self._grouped(x, experts)
        weighted = out.view(t, self.top_k, hidden) * weights.unsqueeze(-1)
        total = weighted.float().sum(dim=1).to(x.dtype)
        if self.tp is not None:
            self.tp.all_reduce(total)
        return total

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair's expert output [T * k, hidden], expert by expert (zero
        for another rank's expert)."""
        t, hidden = x.shape
        pairs = experts.flatten()  # pair p: token p // k, its (p % k)-th expert
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        held = self._held.tolist()
        out = x.new_empty(t * self.top_k, hidden) if all(held) else x.new_zeros(t * self.top_k, hidden)
        start = 0
        for expert, count, here in zip(self.experts, counts, held):
            rows = order[start:start + count]
            start += count
            if count == 0 or not here:
                continue
            (gate_up, gate_up_bias), (down, down_bias) = self.projections(expert)
            h = self.ops.linear(x[rows // self.top_k], gate_up, gate_up_bias)
            out[rows] = self.ops.linear(self.act(h), down, down_bias)
        return out
