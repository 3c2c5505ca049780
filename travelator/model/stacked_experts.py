"""gpt-oss's checkpoints hold every expert of a layer in one tensor per projection (gate and
up interleaved; MXFP4 in the released ones); ``StackedExperts.per_expert`` hands them to the
model's loader expert by expert, under the names the other mixtures' checkpoints use."""

from __future__ import annotations

import torch

# MXFP4 (gpt-oss checkpoints): blocks of 32 four-bit e2m1 codes, two to a byte (the low
# nibble first), and a power-of-two scale per block, 2 ** (byte - 127).
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., n, 16], scales uint8 [..., n] -> float32 [..., 32 n]."""
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., n, 32]
    values = table[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2)


class StackedExperts:
    """gpt-oss's checkpoint tensors hold every expert of a layer in one tensor; the model loads
    experts one by one under the per-expert names (``mlp.experts.3.gate_proj.weight``), as the
    other families' checkpoints name them. ``per_expert`` passes every other tensor through.

    - ``mlp.experts.gate_up_proj`` [experts, hidden, 2 inter], gate and up interleaved along the
      last dimension (gate the even columns), and its bias [experts, 2 inter], likewise;
    - ``mlp.experts.down_proj`` [experts, inter, hidden] and its bias [experts, hidden];
    - or, quantized (MXFP4), ``{gate_up,down}_proj_blocks`` [experts, out, in / 32, 16] with
      ``_scales`` [experts, out, in / 32], in (out, in) order: dequantized here, as they arrive in
      pairs (the 4-bit codes are not kept)."""

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
                tensor, tail = dequantize_mxfp4(blocks, scales).transpose(1, 2), base  # as the float one
            yield from _unstack(prefix, tail, tensor)
        if self._halves:
            raise ValueError(f"MXFP4 tensors without their other half: {sorted(self._halves)}")


_STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias",
            "gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


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
