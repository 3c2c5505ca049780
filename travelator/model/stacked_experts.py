"""gpt-oss's checkpoints hold every expert of a layer in one tensor per projection (gate and
up interleaved; MXFP4 in the released ones); ``StackedExperts.per_expert`` hands them to the
model's loader expert by expert, under the names the other mixtures' checkpoints use."""

from __future__ import annotations

import torch

from travelator.model.quant import BlockQuantized, mxfp4_blocks


def mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor) -> list[BlockQuantized]:
    """A checkpoint's MXFP4 tensor, blocks uint8 [experts, out, n, 16] (32 e2m1 codes a block,
    two to a byte, the low nibble first) and scales uint8 [experts, out, n] (e8m0 exponents),
    as each expert's blocks [out, 32 n], kept 4-bit."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-3)
    return [mxfp4_blocks(codes[e], scales[e]) for e in range(blocks.shape[0])]


class StackedExperts:
    """gpt-oss's checkpoint tensors hold every expert of a layer in one tensor; the model loads
    experts one by one under the per-expert names (``mlp.experts.3.gate_proj.weight``), as the
    other families' checkpoints name them. ``per_expert`` passes every other tensor through.

    - ``mlp.experts.gate_up_proj`` [experts, hidden, 2 inter], gate and up interleaved along the
      last dimension (gate the even columns), and its bias [experts, 2 inter], likewise;
    - ``mlp.experts.down_proj`` [experts, inter, hidden] and its bias [experts, hidden];
    - or, quantized (MXFP4), ``{gate_up,down}_proj_blocks`` [experts, out, in / 32, 16] with
      ``_scales`` [experts, out, in / 32], in (out, in) order: each expert's as its blocks
      (``BlockQuantized``, which the model keeps 4-bit or dequantizes), once both have arrived."""

    def __init__(self) -> None:
        self._halves: dict[str, torch.Tensor] = {}  # an MXFP4 tensor's blocks or scales, awaiting the other

    def per_expert(self, weights):
        for name, tensor in weights:
            prefix, _, tail = name.rpartition(".experts.")
            if not prefix.endswith("mlp") or tail not in _STACKED:
                yield name, tensor
                continue
            if tail.endswith(("_blocks", "_scales")):
                base = tail.rsplit("_", 1)[0]
                other = self._halves.pop(f"{prefix}.{base}", None)
                if other is None:
                    self._halves[f"{prefix}.{base}"] = tensor
                    continue
                blocks, scales = (tensor, other) if tail.endswith("_blocks") else (other, tensor)
                yield from _unstack_blocks(prefix, base, mxfp4_experts(blocks, scales))
                continue
            yield from _unstack(prefix, tail, tensor)
        if self._halves:
            raise ValueError(f"MXFP4 tensors without their other half: {sorted(self._halves)}")


_STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias",
            "gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def _unstack_blocks(prefix: str, tail: str, experts: list[BlockQuantized]):
    """Each expert's MXFP4 blocks [out, in] as its HF-named weights (gate and up rows
    de-interleaved)."""
    for e, blocks in enumerate(experts):
        name = f"{prefix}.experts.{e}."
        if tail == "gate_up_proj":
            yield name + "gate_proj.weight", blocks.rows(slice(0, None, 2))
            yield name + "up_proj.weight", blocks.rows(slice(1, None, 2))
        else:
            yield name + "down_proj.weight", blocks


def _unstack(prefix: str, tail: str, tensor: torch.Tensor):
    """One stacked gpt-oss tensor as per-expert HF-named ones (gate and up de-interleaved)."""
    for e in range(tensor.shape[0]):
        name = f"{prefix}.experts.{e}."
        t = tensor[e]
        if tail == "gate_up_proj":  # [hidden, 2 inter]
            yield name + "gate_proj.weight", t[:, 0::2].T.contiguous()
            yield name + "up_proj.weight", t[:, 1::2].T.contiguous()
        elif tail == "gate_up_proj_bias":
            yield name + "gate_proj.bias", t[0::2].contiguous()
            yield name + "up_proj.bias", t[1::2].contiguous()
        elif tail == "down_proj":  # [inter, hidden]
            yield name + "down_proj.weight", t.T.contiguous()
        else:
            yield name + "down_proj.bias", t
