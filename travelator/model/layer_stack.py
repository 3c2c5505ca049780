"""Every decoder layer of a step in one native call, where every linear layer streams.

A step of a few rows (a decode of one or a few requests) spends a large share of its time
in Python between the kernels: module calls, views and ``torch.ops`` argument parsing. ``csrc/layer_stack.cpp`` runs the same kernels in the same
order from C++ (the same bits as the Python layers, which tests check), for steps where the
Python path would send every linear layer to a streaming kernel: bf16 weights through
``small_m_linear`` (no bias), ``blocked_linear`` or (AVX2) ``panel_linear``, int8/int4 through the integer kernel, at most
``NativeOps.streaming_rows`` rows (the routes of model/linear_route.py; ``blocked_linear`` takes
every row count, so a model whose bf16 layers all take it runs every step here, prompts too).
Anything else (more rows, tensor or pipeline parallelism, the torch kernels, attention's torch
backend, a KV cache of another dtype) runs the Python layers. Quantized layers that keep a bf16
copy on the BLOCKED route take it past the integer kernel's rows, as the Python layers do: a
second encoding of the linear layers names the copies, for those steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from travelator.model.attention import AttentionMetadata
from travelator.model.layers import RotaryEmbedding
from travelator.model.moe import SparseMoE
from travelator.model.native_linear import StreamingLinears


# Families whose layers the native stack does not run: Gemma 3's sandwich norms, two ropes and
# unit-offset norms are the Python layers' (model/gemma3.py). gpt-oss (sinks, biases, its own
# activation) runs its Python layers too.
STACKLESS_FAMILIES = ("gemma3",)


@dataclass(frozen=True, slots=True)
class LayerStack:
    """The per-layer arguments of ``decoder_layers``, gathered once from a model."""

    norms: list[torch.Tensor]  # per layer input and post-attention norm weights, then the final norm
    head_norms: list[torch.Tensor]  # per layer the q and k head norm weights (Qwen3), else empty
    # The linear layers as csrc/layer_stack.cpp reads them, with the kinds of weights held, as
    # ``streaming_rows`` takes them (their row limits differ).
    linears: StreamingLinears
    # The same with every quantized layer's kept bf16 copy in its place, for steps past the
    # integer kernels' rows; None where one keeps none (or the model has experts).
    copied: StreamingLinears | None
    windows: list[int]  # per layer its attention's sliding window, 0 for none
    experts: list[int]  # per layer its mixture's experts, 0 for a dense MLP
    top_k: int  # a mixture's experts per token
    renormalize: bool  # whether a mixture renormalises its top-k
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float

    @staticmethod
    def of(model) -> LayerStack | None:
        """The stack of a LlamaModel, or None where its layers cannot run natively."""
        ops = model.ops
        if model.tp is not None or model.stage is not None or model.dtype not in (torch.bfloat16, torch.float32):
            return None
        arch = model.arch
        if arch.family in STACKLESS_FAMILIES or arch.attention_sinks or arch.output_bias or arch.expert_bias:
            return None
        if arch.num_experts and not hasattr(torch.ops.travelator, "moe_experts"):
            return None
        norms, head_norms, windows, experts = [], [], [], []
        linears, copied = StreamingLinears(), StreamingLinears()
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms += [layer.input_norm.weight, layer.post_attn_norm.weight]
            windows.append(attn.attn.window or 0)
            if attn.q_norm is not None:
                head_norms += [attn.q_norm.weight, attn.k_norm.weight]
            experts.append(len(mlp.experts) if isinstance(mlp, SparseMoE) else 0)
            for weight, bias in ((attn.qkv_weight, attn.qkv_bias), (attn.o_weight, None), *_mlp_linears(mlp)):
                spec = ops.streaming_linear(weight, bias)
                if spec is None or (not spec.quantized and model.dtype != torch.bfloat16):
                    return None
                linears.append(spec)
                copied.append((ops.streaming_copy(weight, bias) or spec) if spec.quantized else spec)
        norms.append(model.norm.weight)
        first = model.layers[0].self_attn
        has_copies = (not any(experts) and any(quantized for quantized, _, _ in linears.row_kinds)
                      and not any(quantized for quantized, _, _ in copied.row_kinds))
        return LayerStack(norms, head_norms, linears, copied if has_copies else None, windows, experts,
                          arch.experts_per_token, arch.norm_topk_prob, model.dtype, first.num_heads, first.num_kv_heads,
                          first.head_dim, model.layers[0].input_norm.eps, first.attn.scale)

    def linears_for(self, ops, rows: int, meta: AttentionMetadata,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> StreamingLinears | None:
        """The encoding of the linear layers with which the stack runs a step of ``rows`` rows as
        the Python layers would (their streaming kernels, native attention), or None where it
        cannot: the integer kernels' up to their rows, the kept copies past them all."""
        if meta.backend != "native" or kv_caches[0][0].dtype not in (self.dtype, torch.int8):
            return None
        if all(rows <= ops.streaming_rows(*kind) for kind in self.linears.row_kinds):
            return self.linears
        if self.copied is None or any(rows <= ops.streaming_rows(*kind) for kind in self.linears.row_kinds if kind[0]):
            return None
        return self.copied if all(rows <= ops.streaming_rows(*kind) for kind in self.copied.row_kinds) else None

    @staticmethod
    def k_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        return [k for k, _ in kv_caches]

    @staticmethod
    def v_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        return [v for _, v in kv_caches]

    def __call__(self, ops, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                 linears: StreamingLinears) -> torch.Tensor:
        """The final norm of the residual stream after every layer (x: the embedded tokens,
        updated in place), as LlamaModel.forward returns it; ``linears``: ``linears_for``'s."""
        return ops.decoder_layers(x, positions, rope, meta, kv_caches, self, linears)


def _mlp_linears(mlp) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """A layer's MLP linear layers in the stack's order: gate/up and down, or a mixture's router
    and each expert's gate/up and down."""
    if not isinstance(mlp, SparseMoE):
        return [(mlp.gate_up_weight, None), (mlp.down_weight, None)]
    pairs = [(mlp.router_weight, mlp.router_bias)]
    for expert in mlp.experts:
        pairs += [(expert.gate_up_weight, expert.gate_up_bias), (expert.down_weight, expert.down_bias)]
    return pairs
