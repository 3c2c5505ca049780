"""Which linear layers are quantized at load, and how: the policy ``LlamaModel`` asks while
it installs weights (llama.py keeps the mechanics: building, packing and installing them).

Two sources of quantized weights:

- ``quantization`` int8 or int4: every QUANTIZABLE layer is quantized as its rows stream in
  (int4 where the layer's shape allows it, else int8; an untied LM head by its own method).
- otherwise a GGUF file's blocks (``BlockQuantized``; an MXFP4 checkpoint's too) stay quantized
  in their own form, on one rank or in an expert placed whole on its rank (``keep_gguf_quants``),
  unless an earlier part of the same fused weight was float.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from travelator.model.quant import GGUF_BLOCK, BlockQuantized, Codebook, QuantMethod, int4_shape_ok

logger = logging.getLogger(__name__)

# The linear layers ``quantization`` applies to: an untied LM head too (a tied one is also the
# embedding, whose rows are read as they are).
# A mixture's experts (``mlp.experts.3.gate_up_weight``) are quantized like the MLP; its router is not.
QUANTIZABLE = ("self_attn.qkv_weight", "self_attn.o_weight", "gate_up_weight", "down_weight", "lm_head")


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """How one weight is stored: int8 per output channel or int4 in groups of ``group_size``
    (e2m1 codes: an MXFP4 weight kept as it was loaded)."""

    method: QuantMethod
    group_size: int
    codebook: Codebook = "uniform"


class QuantPolicy:
    """The load-time quantization settings of one model, and what they mean for each weight
    (named as the model's parameters: ``layers.3.mlp.down_weight``, ``lm_head``)."""

    def __init__(self, quantization: QuantMethod | None = None, group_size: int = 128,
                 keep_gguf_quants: bool = True, lm_head_quantization: str = "auto", tp_size: int = 1) -> None:
        self.quantization, self.group_size = quantization, group_size
        # An untied LM head's method under quantization (None: kept as loaded); auto is int8.
        self.lm_head_method: QuantMethod | None = {"auto": "int8", "none": None}.get(
            lm_head_quantization, lm_head_quantization)
        self.keep_gguf_quants = keep_gguf_quants
        self.tp_size = tp_size
        self._int8_fallbacks: set[tuple[int, int]] = set()  # shapes already warned about

    def quantizes(self, target: str) -> bool:
        """Whether ``quantization`` (int8/int4) applies to this weight."""
        if target == "lm_head" and self.lm_head_method is None:
            return False
        return self.quantization is not None and target.endswith(QUANTIZABLE)

    def method_for(self, target: str, shape: tuple[int, int]) -> QuantMethod:
        """int4 where the layer's shape allows it (its kernel's tiling), else int8, said once.
        The LM head is int8 under int4 too unless lm_head_quantization says otherwise: its error
        goes straight into the logits (llama.cpp's Q4 mixes keep their output layer at 6 bits or
        more for the same reason)."""
        method = self.lm_head_method if target == "lm_head" else self.quantization
        if method == "int4" and not int4_shape_ok(*shape, self.group_size):
            if shape not in self._int8_fallbacks:
                self._int8_fallbacks.add(shape)
                logger.warning("int4 needs the input size to be a multiple of the group size (%d): "
                               "layers of shape %s (like %s) are int8", self.group_size, shape, target)
            return "int8"
        return method

    def for_random(self, target: str, shape: tuple[int, int]) -> QuantFormat | None:
        """How a random (dummy) weight of this rank's ``shape`` is stored (None: as it is)."""
        if not self.quantizes(target):
            return None
        return QuantFormat(self.method_for(target, shape), self.group_size)

    def for_checkpoint(self, target: str, first: torch.Tensor | BlockQuantized, shape: tuple[int, int],
                       earlier_parts: int, whole: bool = False) -> QuantFormat | None:
        """How the weight ``target`` (this rank's ``shape``) is stored, decided at the first of
        its checkpoint tensors to arrive, ``first`` (None: into the parameter as it is).
        ``earlier_parts``: parts of the same fused weight already written, as float (a GGUF
        weight whose first part was float stays float: its rows are already in the parameter).
        ``whole``: this rank holds the weight whole (an expert placed on it), so its blocks
        need no cutting, whatever the ranks."""
        if not target.endswith(QUANTIZABLE):
            return None
        if self.quantization is not None:
            if not self.quantizes(target):  # an LM head kept as loaded
                return None
            return QuantFormat(self.method_for(target, shape), self.group_size)
        if (isinstance(first, BlockQuantized) and self.keep_gguf_quants and (self.tp_size == 1 or whole)
                and earlier_parts == 0):
            method: QuantMethod = first.method
            if method == "int4" and not int4_shape_ok(*shape, GGUF_BLOCK):
                return QuantFormat("int8", GGUF_BLOCK)
            return QuantFormat(method, GGUF_BLOCK, first.codebook if method == "int4" else "uniform")
        return None
