"""A mixture of experts in place of the gated MLP (Mixtral, Qwen3-MoE), for one flat batch of
tokens [T, hidden].

The router scores every expert per token (a linear layer, then a float32 softmax); each token
takes its ``experts_per_token`` largest, renormalised where the config says so. The experts
then run as grouped work: the step's (token, expert) pairs are sorted by expert and each expert
used by the step multiplies all of its rows at once through ``ops.linear`` (so every weight
format and route of the dense layers serves experts too); an expert no token chose is never
read. Each pair's output lands in its own row, and a token's outputs are summed in the order
of its own top-k, in float32: a token's numbers never depend on which others share the step
(batch invariance), given linear kernels whose rows are independent.

A step of a few tokens with bf16 experts runs them in one native call instead
(``ops.moe_experts``, csrc/moe_experts.cpp), with the same numbers: a decode of one request
would otherwise spend more time between its kernels than in them.

Tensor parallelism splits every expert's intermediate size over the ranks like the dense MLP
(gate/up by rows, down by columns), with one all-reduce of the layer's output.
"""

from __future__ import annotations

import torch
from torch import nn

from travelator.model.arch import ModelArch
from travelator.model.blocks import param
from travelator.model.ops import TorchOps
from travelator.model.tp_group import TPGroup


class Expert(nn.Module):
    """One expert: a SwiGLU MLP of the experts' intermediate size (this rank's share)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_weight = param(2 * inter, hidden, dtype=dtype)
        self.down_weight = param(hidden, inter, dtype=dtype)


class SparseMoE(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, ops: TorchOps, tp: TPGroup | None = None) -> None:
        super().__init__()
        size = tp.size if tp is not None else 1
        self.ops = ops
        self.tp = tp
        self.top_k = arch.experts_per_token
        self.renormalize = arch.norm_topk_prob
        self.router_weight = param(arch.num_experts, arch.hidden_size, dtype=dtype)
        inter = arch.expert_intermediate_size // size
        self.experts = nn.ModuleList(Expert(arch.hidden_size, inter, dtype) for _ in range(arch.num_experts))
        self._plain_weights: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def plain_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Every expert's gate/up and down weights, for a kernel that runs the experts in one
        call (``ops.moe_experts``); None where some are quantized (they take ops.linear)."""
        if self._plain_weights is None:
            gate_up = [e.gate_up_weight for e in self.experts]
            down = [e.down_weight for e in self.experts]
            if all(isinstance(w, torch.Tensor) for w in gate_up + down):
                self._plain_weights = (gate_up, down)
        return self._plain_weights

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] (largest score first) and their weights [T, k], rounded
        to the model dtype as the reference rounds them."""
        logits = self.ops.linear(x, self.router_weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, hidden = x.shape
        experts, weights = self.route(x)
        plain = self.plain_weights()
        out = None if plain is None else self.ops.moe_experts(x, experts, *plain)
        if out is None:
            out = self._grouped(x, experts)
        weighted = out.view(t, self.top_k, hidden) * weights.unsqueeze(-1)
        total = weighted.float().sum(dim=1).to(x.dtype)
        if self.tp is not None:
            self.tp.all_reduce(total)
        return total

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair's expert output [T * k, hidden], expert by expert."""
        t, hidden = x.shape
        pairs = experts.flatten()  # pair p: token p // k, its (p % k)-th expert
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        out = x.new_empty(t * self.top_k, hidden)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count == 0:
                continue
            rows = order[start:start + count]
            start += count
            h = self.ops.linear(x[rows // self.top_k], expert.gate_up_weight)
            out[rows] = self.ops.linear(self.ops.silu_and_mul(h), expert.down_weight)
        return out
