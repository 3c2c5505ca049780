"""The per-token operations of the Llama block, in three implementations.

``TorchOps`` is plain torch: the reference, and the path on machines where the native
kernels do not build. ``TritonOps`` is the same with the paged attention and the sampler's
exponential race in Triton, the path on CUDA devices. ``NativeOps`` runs the same operations through
travelator's C++ CPU kernels (fused RMSNorm with the residual add, SiLU * up, rotary in
place, paged attention in one call per layer, a vectorised argmax for the sampler) and its
linear layers through ``NativeLinear`` (model/native_linear.py), which decides each weight's
route once, when the weights are prepared.

With ``batch_invariant``, ``NativeOps`` makes every row's numbers independent of the other
rows of the step (see model/native_linear.py and docs/design.md).

The model holds one of them for its whole life; ``make_ops`` picks it from the
``kernels`` and ``batch_invariant`` settings.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from travelator import kernels
from travelator.model.attention import AttentionBackend
from travelator.model.layers import RMSNorm, RotaryEmbedding, clamped_swiglu, gelu_tanh_and_mul, silu_and_mul
from travelator.model.linear_route import LinearRoute
from travelator.model.native_linear import NativeLinear, StreamingLinear
from travelator.model.quant import QuantizedWeight, quantized_linear


class TorchOps:
    attention_backend: AttentionBackend = "torch"
    # Prefill tiles on the native path's tiled kernel (numbers depend on the chunking).
    tiled_prefill_attention = False
    # The sampler's native draw (NativeOps); None: torch generators make the noise.
    exponential_race = None

    def prepare(self, linear_weights: Iterable[torch.Tensor], activations: torch.dtype,
                gemm_copies: bool = True) -> None:
        """Called once the weights are final (loaded and on their device); ``activations``: the
        model's dtype, what its linear layers are given; ``gemm_copies``: whether quantized
        weights may keep a bf16 copy for the GEMM (NativeLinear)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, bias)
        return quantized_linear(x, weight, bias)

    def streaming_linear(self, weight: torch.Tensor | QuantizedWeight,
                         bias: torch.Tensor | None) -> StreamingLinear | None:
        """How the native layer stack calls this layer (None: it cannot; torch never does)."""
        return None

    def streaming_copy(self, weight: torch.Tensor | QuantizedWeight,
                       bias: torch.Tensor | None) -> StreamingLinear | None:
        """How the native layer stack calls a quantized layer past its kernel's rows (None: it
        cannot)."""
        return None

    def streaming_rows(self, quantized: bool, int8: bool = False, blocked: bool = False) -> int:
        """The most rows of x for which ``linear`` takes the streaming kernel that
        ``streaming_linear`` names (0: none); int8: for an int8 weight; blocked: for a weight
        on the BLOCKED route."""
        return 0

    def moe_experts(self, x: torch.Tensor, experts: torch.Tensor, stack) -> torch.Tensor | None:
        """A mixture's experts in one call (``stack``: a model/moe.ExpertStack, which covers
        the step's rows), or None where the ops have no such kernel: every (token, expert)
        pair's MLP output, [T * k, hidden]."""
        return None

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual stream and the next block's input."""
        x = x + delta
        return x, norm(x)

    def head_rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``norm`` over the last dimension of every head of x [T, heads, head_dim] (Qwen3's
        q/k norm); the native kernel writes x in place, through a view of the QKV output."""
        return norm(x)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): the tanh-approximated GELU of the gate times up."""
        return gelu_tanh_and_mul(gate_up)

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's experts' activation (layers.clamped_swiglu)."""
        return clamped_swiglu(gate_up, alpha, limit)

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        return rope(positions, q, k)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first largest index (the sampler's greedy pick)."""
        return x.argmax(dim=-1)

    def apply_token_bitmask(self, logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor) -> None:
        """Structured outputs, in place: ``logits[rows[k], j] = -inf`` where bit ``j % 32`` of
        ``masks[k, j // 32]`` (int32 words, llguidance's layout) is 0."""
        bits = torch.arange(32, dtype=torch.int32, device=masks.device)
        allowed = ((masks.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : logits.shape[1]].bool()
        logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))


class TritonOps(TorchOps):
    """torch for the dense work; in Triton, the paged attention (GPU) for the per-request part
    and the sampler's exponential race, its noise drawn on the device from each row's seed."""

    attention_backend: AttentionBackend = "triton"

    def __init__(self) -> None:
        from travelator.kernels import triton_sampling  # imports triton: only on this path

        self._race = triton_sampling.exponential_race

    def exponential_race(self, scores: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        return self._race(scores, seeds)


class NativeOps(TorchOps):
    attention_backend: AttentionBackend = "native"

    def __init__(self, batch_invariant: bool = False, bf16_gemm: bool | None = None) -> None:
        """bf16_gemm: whether bf16 weights go to oneDNN's bf16 GEMM (see NativeLinear)."""
        kernels.load()
        self._ops = torch.ops.travelator
        self._linear = NativeLinear(batch_invariant, bf16_gemm)
        # Likewise the tiled attention kernel for prefill tiles.
        self.tiled_prefill_attention = not batch_invariant

    @property
    def quant_kernel_rows(self) -> int:
        """Rows of x up to which a quantized layer takes the integer kernel."""
        return self._linear.quant_kernel_rows

    @quant_kernel_rows.setter
    def quant_kernel_rows(self, rows: int) -> None:
        self._linear.quant_kernel_rows = rows

    @property
    def w8a8_rows(self) -> int:
        """Rows of x from which an int8 layer takes the W8A8 kernel (0: never)."""
        return self._linear.w8a8_rows

    @w8a8_rows.setter
    def w8a8_rows(self, rows: int) -> None:
        self._linear.w8a8_rows = rows

    def prepare(self, linear_weights, activations, gemm_copies=True):
        self._linear.prepare(linear_weights, activations, gemm_copies)

    @property
    def gemm_copies(self) -> bool:
        """Whether quantized weights past the integer kernel's rows take a kept bf16 copy."""
        return self._linear.gemm_copies

    @property
    def gemm_copies_refused(self) -> str:
        """Why quantized weights keep no bf16 copy ("": they do, or none could)."""
        return self._linear.gemm_copies_refused

    def linear_route(self, weight: torch.Tensor | QuantizedWeight) -> LinearRoute | None:
        """The route ``prepare`` chose for the weight (None: it runs as loaded)."""
        return self._linear.route(weight)

    @property
    def blocked_on_tiles(self) -> bool:
        """Whether BLOCKED weights run on AMX's tiles (else on vdpbf16ps)."""
        return bool(self._linear.blocked_on_tiles)

    def linear(self, x, weight, bias=None):
        return self._linear(x, weight, bias)

    def streaming_linear(self, weight, bias):
        return self._linear.streaming_linear(weight, bias)

    def streaming_copy(self, weight, bias):
        return self._linear.streaming_copy(weight, bias)

    def streaming_rows(self, quantized, int8=False, blocked=False):
        return self._linear.streaming_rows(quantized, int8, blocked)

    def moe_experts(self, x, experts, stack):
        if not hasattr(self._ops, "moe_experts"):
            return None
        return self._ops.moe_experts(x.contiguous(), experts, stack.linear_tensors, stack.linear_ints)

    def decoder_layers(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, meta,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], stack, linears) -> torch.Tensor:
        """Every decoder layer in one native call (``stack``: a model/layer_stack.LayerStack;
        ``linears``: the encoding of its linear layers this step takes)."""
        return self._ops.decoder_layers(
            x, positions, rope.cos, rope.sin, meta.slot_mapping, meta.query_start, meta.seq_lens,
            meta.block_tables, stack.norms, stack.head_norms, stack.k_caches(kv_caches), stack.v_caches(kv_caches),
            linears.tensors, linears.ints, stack.windows, stack.experts, stack.top_k, stack.renormalize,
            stack.num_heads, stack.num_kv_heads, stack.head_dim, stack.eps, stack.scale, meta.tiled_prefill)

    # Gemma's unit-offset norms (1 + w, rounded once) run in torch: the kernels round as Llama's.
    def rms_norm(self, x, norm):
        if norm.unit_offset:
            return super().rms_norm(x, norm)
        return self._ops.rms_norm(x, norm.weight, norm.eps)

    def add_rms_norm(self, x, delta, norm):
        if norm.unit_offset:
            return super().add_rms_norm(x, delta, norm)
        normed = self._ops.add_rms_norm_(x, delta, norm.weight, norm.eps)  # x += delta in place
        return x, normed

    def head_rms_norm(self, x, norm):
        if norm.unit_offset:
            return super().head_rms_norm(x, norm)
        self._ops.head_rms_norm_(x, norm.weight, norm.eps)
        return x

    def silu_and_mul(self, gate_up):
        return self._ops.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up):
        return self._ops.gelu_tanh_and_mul(gate_up)

    def rope(self, positions, q, k, rope):
        self._ops.rope_(q, k, positions, rope.cos, rope.sin)  # in place, through the views
        return q, k

    def argmax(self, x):
        if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.is_contiguous():
            return x.argmax(dim=-1)
        return self._ops.argmax_rows(x)

    def exponential_race(self, scores: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        return self._ops.exponential_race(scores, seeds)

    def apply_token_bitmask(self, logits, masks, rows):
        if not logits.is_contiguous():
            return super().apply_token_bitmask(logits, masks, rows)
        self._ops.apply_token_bitmask_(logits, masks, rows)


def make_ops(kernels_setting: str, device: torch.device, batch_invariant: bool = False) -> TorchOps:
    """``auto``: the native kernels on the CPU where they build, else torch. The
    batch-invariant mode needs the native kernels (the torch path's attention and GEMMs
    change their reduction order with the batch)."""
    if kernels_setting not in ("auto", "native", "triton", "torch"):
        raise ValueError(f"unknown kernels {kernels_setting!r}; use auto, native, triton or torch")
    if batch_invariant:
        if kernels_setting == "torch" or device.type != "cpu":
            raise ValueError("batch_invariant needs the native CPU kernels (kernels='native' or "
                             "'auto' on a CPU)")
        if not kernels.available():
            raise ValueError("batch_invariant needs the native CPU kernels, which do not build "
                             "here (see the warning above)")
        return NativeOps(batch_invariant=True)
    if kernels_setting == "triton":
        return _triton_ops(device)
    if kernels_setting == "auto" and device.type == "cuda":
        return TritonOps() if importlib.util.find_spec("triton") is not None else TorchOps()
    if kernels_setting == "torch" or (kernels_setting == "auto" and device.type != "cpu"):
        return TorchOps()
    if device.type != "cpu":
        raise ValueError("the native kernels run on the CPU only; use kernels='torch' or 'auto'")
    if kernels_setting == "native":
        return NativeOps()  # raises with the compiler's message
    return NativeOps() if kernels.available() else TorchOps()


def native_kernels_chosen(kernels_setting: str, device: torch.device) -> bool:
    """Whether ``make_ops`` gives these settings the native CPU kernels (where it does not
    raise): the dtype the engine picks depends on it."""
    return device.type == "cpu" and kernels_setting in ("auto", "native") and kernels.available()


def _triton_ops(device: torch.device) -> TritonOps:
    """Triton compiles for CUDA devices; its interpreter (TRITON_INTERPRET=1) runs the same
    kernels on the CPU, which is how the tests check them without a GPU."""
    if importlib.util.find_spec("triton") is None:
        raise ValueError("kernels='triton' needs the triton package (CUDA builds of torch bring it)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"kernels='triton' runs on a CUDA device; the device is {device} "
                         "(TRITON_INTERPRET=1 runs it on the CPU, slowly, for tests)")
    return TritonOps()
