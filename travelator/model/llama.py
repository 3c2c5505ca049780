"""The decoder model of every supported architecture, written for flat batches: the Llama
family's decoder layer (Llama, Mistral, Qwen2, Qwen3, Phi-3) and, around any architecture's
layers (``LAYERS``: Gemma 3's in gemma3.py), the embedding, final norm, LM head, weight loading,
tensor parallelism and quantized weights (which layers and how: quant_policy.py).

Qwen3 is Llama with each query and key head RMS-normalised before rope (``ModelArch.qk_norm``);
Phi-3 is Llama with fused checkpoint tensors, LongRoPE and partial rotary.

Selective batching: embedding, norms, the fused QKV and output projections, the
MLP and the LM head run once over all tokens of all requests in the step; only
attention looks at requests one by one (see attention.py).

Tensor parallelism (Megatron style), when a ``TPGroup`` is given: the fused QKV and
gate/up projections are split by output rows (each rank holds its own query and KV
heads, and its share of the MLP), the output and down projections by input columns
and followed by an all-reduce; the embedding and the LM head are split over the
vocabulary (out-of-range ids embed to zero, then all-reduce; local logits are gathered
on the driver). Norms are replicated. Without a group nothing of this runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from travelator.model.arch import ModelArch
from travelator.model.attention import AttentionMetadata
from travelator.model.blocks import MLP, Attention, param
from travelator.model.gemma3 import Gemma3DecoderLayer
from travelator.model.layer_stack import LayerStack
from travelator.model.layers import RMSNorm, RotaryEmbedding
from travelator.model.model_file_error import ModelFileError
from travelator.model.moe import SparseMoE
from travelator.model.stacked_experts import StackedExperts
from travelator.model.ops import TorchOps
from travelator.model.quant import BlockQuantized, QuantizedBuilder, QuantizedWeight, QuantMethod, quantize
from travelator.model.quant_policy import QuantPolicy
from travelator.model.pp_stage import PipelineStage
from travelator.model.tp_group import TPGroup, check_divisible
from travelator.model.weight_layout import LAYER_TENSORS, MODEL_TENSORS, expert_target, parameter_layout


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x)).

    The last add is left to the next norm: a layer takes the residual stream as ``x`` plus
    the previous block's ``delta`` (None before the first layer) and returns the same pair,
    so every add rides on a fused add + RMSNorm pass.
    """

    def __init__(self, arch: ModelArch, dtype: torch.dtype, ops: TorchOps, layer: int,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, dtype, ops, layer, tp)
        self.post_attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = SparseMoE(arch, dtype, ops, tp) if arch.is_moe_layer(layer) else MLP(arch, dtype, ops, tp)

    def forward(self, x, delta, positions, rope: RotaryEmbedding, k_cache, v_cache, meta):
        if delta is None:
            normed = self.ops.rms_norm(x, self.input_norm)
        else:
            x, normed = self.ops.add_rms_norm(x, delta, self.input_norm)  # x + delta, and its norm
        h = self.self_attn(normed, positions, rope, k_cache, v_cache, meta)
        x, normed = self.ops.add_rms_norm(x, h, self.post_attn_norm)
        return x, self.mlp(normed)


# The decoder layer of each family (others: DecoderLayer).
LAYERS: dict[str, type[nn.Module]] = {"gemma3": Gemma3DecoderLayer}


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, max_positions: int,
                 tp: TPGroup | None = None, ops: TorchOps | None = None,
                 quantization: QuantMethod | None = None, group_size: int = 128,
                 keep_gguf_quants: bool = True, lm_head_quantization: str = "auto",
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.ops = ops if ops is not None else TorchOps()
        # Weight-only quantization (which layers, how: quant_policy.py): each quantized weight is
        # built as its rows stream in, and its full-precision parameter (allocated, never
        # written) is dropped.
        self.quant_policy = QuantPolicy(quantization, group_size, keep_gguf_quants, lm_head_quantization,
                                        tp.size if tp is not None else 1)
        if tp is not None:
            check_divisible(arch, tp.size, tp.expert_parallel)
        self.arch = arch
        self.dtype = dtype
        self.tp = tp
        self.tp_rank, self.tp_size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.shards, self.full_shapes = parameter_layout(arch, tp if tp is not None and tp.expert_parallel else None)
        vocab = self.shards["embed"].local_shape(self.full_shapes["embed"], self.tp_size)[0]
        self.vocab_start = self.tp_rank * vocab  # this rank's slice of the vocabulary
        # Pipeline parallelism: this stage's layers only (others are placeholders, so that layer i
        # keeps its name), the embedding on the first stage, the norm and the head on the last.
        self.stage = stage
        self.local_layers = range(0, arch.num_layers) if stage is None else range(stage.start, stage.end)
        self.holds_head = stage is None or stage.is_last
        tied = arch.tie_word_embeddings
        holds_embed = stage is None or stage.holds_embedding(tied)
        self.embed = param(vocab, arch.hidden_size, dtype=dtype) if holds_embed else None
        self.layers = nn.ModuleList(self._layer(i, tp) if i in self.local_layers else nn.Identity()
                                    for i in range(arch.num_layers))
        self.norm = (RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, unit_offset=arch.norm_unit_offset)
                     if self.holds_head else None)
        self.lm_head = param(vocab, arch.hidden_size, dtype=dtype) if self.holds_head and not tied else None
        self.rope = RotaryEmbedding(arch.rotary_size, max_positions, arch.rope_theta, arch.rope_scaling)
        # Gemma 3: sliding layers turn by their own base, without the model's rope scaling.
        local = (RotaryEmbedding(arch.rotary_size, max_positions, arch.local_rope_theta, None)
                 if arch.local_rope_theta is not None else self.rope)
        self.rope_of_layer = [self.rope if arch.window_of(i) is None else local for i in range(arch.num_layers)]
        # Steps the native layer stack covers run every layer in one call (model/layer_stack.py),
        # with the same results; False keeps them on the Python layers (tests compare the two).
        self.use_layer_stack = True
        self._layer_stack: LayerStack | None = None  # gathered at the first forward: weights are final then
        self._layer_stack_gathered = False

    def _layer(self, i: int, tp: TPGroup | None) -> nn.Module:
        return LAYERS.get(self.arch.family, DecoderLayer)(self.arch, self.dtype, self.ops, i, tp)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    def weight_bytes(self) -> int:
        """Bytes the weights take in memory (quantized ones as stored)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        return total + sum(w.nbytes for w in self.linear_weights() if not isinstance(w, torch.Tensor))

    def _install(self, target: str, weight: QuantizedWeight) -> None:
        """Put a quantized weight where its parameter was (which is dropped)."""
        module_name, _, attr = target.rpartition(".")
        module = self.get_submodule(module_name)  # "": the model itself (its LM head)
        del module._parameters[attr]
        setattr(module, attr, weight)

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights that go through ``ops.linear`` (the ops may pre-pack them)."""
        mats = [self.lm_head_weight] if self.holds_head else []
        for layer in (self.layers[i] for i in self.local_layers):
            mats += [layer.self_attn.qkv_weight, layer.self_attn.o_weight]
            if isinstance(layer.mlp, SparseMoE):
                mats.append(layer.mlp.router_weight)
                mats += [w for e in layer.mlp.held_experts() for w in (e.gate_up_weight, e.down_weight)]
            else:
                mats += [layer.mlp.gate_up_weight, layer.mlp.down_weight]
        return mats

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        stage = self.stage
        if stage is None or stage.is_first:
            x, delta = self._embed(input_ids), None
        else:
            x, delta = stage.receive_hidden(input_ids.shape[0], self.arch.hidden_size, self.dtype)
        stack = self._native_layer_stack()
        linears = stack.linears_for(self.ops, x.shape[0], meta, kv_caches) if stack is not None else None
        if linears is not None:
            return stack(self.ops, x, positions, self.rope, kv_caches, meta, linears)
        for i, (k_cache, v_cache) in zip(self.local_layers, kv_caches):  # the caches of this stage's layers
            x, delta = self.layers[i](x, delta, positions, self.rope_of_layer[i], k_cache, v_cache, meta)
        if not self.holds_head:
            stage.send_hidden(x, delta)
            return x  # rows of the right shape only: the last stage computes the logits
        return self.ops.add_rms_norm(x, delta, self.norm)[1]

    def _native_layer_stack(self) -> LayerStack | None:
        if not self.use_layer_stack:
            return None
        if not self._layer_stack_gathered:
            self._layer_stack, self._layer_stack_gathered = LayerStack.of(self), True
        return self._layer_stack

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            x = F.embedding(input_ids, self.embed)
        else:
            # Vocabulary-parallel: ids outside this rank's slice embed to zero, then sum.
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.embed.shape[0])
            x = F.embedding(local.masked_fill(outside, 0), self.embed)
            x = self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))
        if self.arch.embed_scale:  # Gemma: by sqrt(hidden), rounded to the model dtype first
            x = x * torch.tensor(self.arch.hidden_size**0.5).to(x.dtype)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits in the model's dtype (the sampler widens them to float32
        when it needs more than a greedy pick); with tensor parallelism on the driver only
        (the other ranks send their slice and get None). Pipeline parallel: the last stage
        computes them and sends them to the driver, which receives them for its ``hidden`` rows."""
        stage = self.stage
        if stage is not None and not stage.is_last:
            return stage.receive_logits(hidden.shape[0], self.arch.vocab_size, self.dtype) if stage.is_first else None
        logits = self.ops.linear(hidden, self.lm_head_weight)
        if self.tp is not None:
            full = self.tp.gather(logits, dim=-1)
            logits = None if full is None else full[:, : self.arch.vocab_size]
        cap = self.arch.final_logit_softcapping
        if cap is not None and logits is not None:
            logits = torch.tanh(logits / cap) * cap
        if stage is not None:
            stage.send_logits(logits)
            return None
        return logits

    # ---- weights --------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up into our layout.

        With tensor parallelism each incoming tensor is cut to this rank's shard as it
        streams in, so a rank never holds more than its shard plus one full tensor.
        Every parameter must be written exactly once; a missing or unexpected
        tensor, or one of another shape than the model's config gives, is a ModelFileError
        of ``source`` (the model's path), so a truncated or foreign checkpoint never runs.
        """
        params = dict(self.named_parameters())
        written: set[str] = set()
        parts_written: dict[str, int] = {}
        builders: dict[str, QuantizedBuilder] = {}  # quantized weights being filled
        for name, tensor in StackedExperts().per_expert(weights):
            name = name.removeprefix("model.")
            try:
                mapped = self._checkpoint_target(name)
            except KeyError:
                raise ModelFileError(source, f"tensor {name}", "is not a tensor of this model") from None
            if mapped is None or self._held_elsewhere(mapped[0]):
                continue
            target, part = mapped
            if target not in params:
                raise ModelFileError(source, f"tensor {name}", "is not a tensor of this model")
            earlier_parts = parts_written.get(target, 0)
            if part is not None:
                parts_written[target] = earlier_parts + 1
            self._load_tensor(name, tensor, target, part, params[target], earlier_parts, builders, source)
            if part is None or parts_written[target] == len(self.shards[target].parts):
                written.add(target)
                if target in builders:
                    self._install(target, builders.pop(target).finish())
        missing = set(params) - written
        if missing:
            raise ModelFileError(source, None, f"tensors are missing: {sorted(missing)[:5]}")

    def _held_elsewhere(self, target: str) -> bool:
        """Whether parameter ``target`` belongs to another pipeline stage."""
        if self.stage is None:
            return False
        if target.startswith("layers."):
            return not self.stage.holds_layer(int(target.split(".")[1]))
        if target == "embed":
            return self.embed is None
        return not self.holds_head  # the final norm and the LM head

    def _load_tensor(self, name: str, tensor: torch.Tensor | BlockQuantized, target: str, part: int | None,
                     param: torch.Tensor, earlier_parts: int, builders: dict[str, QuantizedBuilder],
                     source: str) -> None:
        """One checkpoint tensor (a whole weight, or part ``part`` of a fused one) into this
        rank's shard of its parameter, or into the builder of its quantized weight."""
        size = self.tp_size
        shard = self.shards[target]
        full_shape = self.full_shapes[target]
        if part is not None:
            full_shape = shard.part_shape(full_shape, part)
        if tuple(tensor.shape) != tuple(full_shape):
            raise ModelFileError(source, f"tensor {name}", f"has shape {tuple(tensor.shape)}; the model's "
                                                           f"config gives {tuple(full_shape)}")
        if not shard.held_by(self.tp_rank):
            return  # another rank's expert
        dest = param.data
        if part is not None:
            dest = dest.narrow(shard.dim, shard.local_offset(part, size), shard.piece(part, size))
        builder = builders.get(target)
        if builder is None:  # the first of its tensors (or all so far went in as float)
            local_shape = tuple(param.shape)
            fmt = self.quant_policy.for_checkpoint(target, tensor, local_shape, earlier_parts,
                                                   whole=shard.owner is not None)
            if fmt is not None:
                builder = builders[target] = QuantizedBuilder(local_shape, fmt.method, fmt.group_size, fmt.codebook)
        if isinstance(tensor, BlockQuantized) and builder is None:
            tensor = tensor.dequantize()
        row0 = shard.local_offset(part, size) if part is not None else 0
        if builder is None:
            dest.copy_(self._rank_piece(tensor, target, part))
        elif isinstance(tensor, BlockQuantized):
            builder.write_blocks(row0, tensor)  # one rank, or a placed expert: no shard to cut
        else:
            builder.write_rows(row0, self._rank_piece(tensor, target, part))

    def _rank_piece(self, tensor: torch.Tensor, target: str, part: int | None) -> torch.Tensor:
        """This rank's piece of a checkpoint tensor: a whole fused tensor (Phi-3's qkv_proj) is
        cut part by part; a part as it is."""
        shard = self.shards[target]
        if part is None:
            return shard.shard(tensor, self.tp_rank, self.tp_size)
        return shard.take(tensor, part, self.tp_rank, self.tp_size)

    def _checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        """(our parameter, index of the fused part) of an HF tensor name, or None for a tensor
        that is not loaded. KeyError for a name this model does not have."""
        if name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: some checkpoints store the copy anyway
        if name in MODEL_TENSORS:
            return MODEL_TENSORS[name], None
        if name.startswith("layers.") and name.count(".") >= 2:
            _, idx, rest = name.split(".", 2)
            if rest in LAYER_TENSORS:
                field, part = LAYER_TENSORS[rest]
                return f"layers.{idx}.{field}", part
            expert = expert_target(rest)
            if expert is not None:
                return f"layers.{idx}.{expert[0]}", expert[1]
        raise KeyError(name)

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights with a realistic scale, for benchmarks without a download.

        Each parameter is drawn whole, in order, from one generator, then cut to this
        rank's shard: every tensor-parallel size gives the same model as one rank. A pipeline
        stage draws the other stages' parameters too, and drops them. They are drawn where the
        model lives (an accelerator draws billions in moments; its stream differs from the CPU's).
        """
        params = dict(self.named_parameters())
        device = next(iter(params.values())).device  # the embedding's, where the stage holds it
        device = device if device.type == "cuda" else torch.device("cpu")
        g = torch.Generator(device=device).manual_seed(seed)
        for name in self._parameter_order():
            p = params.get(name)
            if name.endswith("norm.weight"):
                if p is not None:
                    p.data.fill_(0.0 if self.arch.norm_unit_offset else 1.0)  # a scale of 1 either way
                continue
            full = torch.randn(self.full_shapes[name], generator=g, device=device) * 0.02
            if p is None or not self.shards[name].held_by(self.tp_rank):
                continue  # another stage's, or another rank's expert: drawn all the same
            shard = self.shards[name].shard(full, self.tp_rank, self.tp_size)
            fmt = self.quant_policy.for_random(name, tuple(shard.shape))
            if fmt is not None:
                self._install(name, quantize(shard, fmt.method, fmt.group_size))
            else:
                p.data.copy_(shard)

    def _parameter_order(self) -> list[str]:
        """The names of one rank's parameters in the order it registers them (the dummy
        weights' draw order); a pipeline stage builds the layers it does not hold on the meta
        device to learn theirs."""
        if self.stage is None:
            return [name for name, _ in self.named_parameters()]
        names = ["embed"] + ([] if self.arch.tie_word_embeddings else ["lm_head"])  # the model's own first
        for i, layer in enumerate(self.layers):
            if i not in self.local_layers:
                with torch.device("meta"):
                    layer = self._layer(i, None)
            names += [f"layers.{i}.{name}" for name, _ in layer.named_parameters()]
        return names + ["norm.weight"]
