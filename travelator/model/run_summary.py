"""The one line a user sees at start-up: what the model is stored in and which kernels run it.

The defaults differ by machine (model/device.py's dtype, model/native_linear.py's routes), so a
figure is only comparable with the routes that made it; this line names them.
"""

from __future__ import annotations

from collections import Counter

import torch

from travelator.model.linear_route import STREAMED_BF16_ROWS, STREAMED_QUANTIZED_ROWS, LinearRoute

_ROUTE_WORDS = {
    LinearRoute.ONEDNN_BF16: "oneDNN bf16 GEMM",
    LinearRoute.INT8: "int8 kernel",
    LinearRoute.INT4: "int4 kernel",
    LinearRoute.INT4_FP4: "fp4 (MXFP4) kernel",
    LinearRoute.BLOCKED: "blocked bf16 kernel",
    LinearRoute.PANELS: "bf16 weights, float32 panel kernel",
}


def _route(ops):
    """weight -> its route (None: F.linear, or ops without routes)."""
    return getattr(ops, "linear_route", lambda _weight: None)  # NativeOps only


def route_words(ops, weight) -> str:
    """A linear layer's route in words."""
    route = _route(ops)(weight)
    if route is None:
        return "F.linear" if isinstance(weight, torch.Tensor) else "dequantized by torch"
    if route is LinearRoute.ONEDNN_FLOAT32:
        # A bf16 weight here has no bf16 GEMM on this CPU: stored in bf16, multiplied in float32.
        return "bf16 weights, float32 GEMM" if weight.dtype == torch.bfloat16 else "packed float32 GEMM"
    if route is LinearRoute.BLOCKED and getattr(ops, "blocked_on_tiles", False):
        return "blocked bf16 kernel on AMX tiles"
    return _ROUTE_WORDS[route]


def describe_run(ops, weights: list, dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device) -> str:
    """e.g. "bfloat16 on cpu, native kernels: linear layers 85 bf16 weights, float32 GEMM
    (up to 8 rows streamed); attention native; KV cache bfloat16"."""
    routes = Counter(route_words(ops, w) for w in weights)
    linear = ", ".join(f"{n} {words}" for words, n in routes.most_common())
    # The bf16 weights whose step changes kernels past a few rows (BLOCKED ones take every count).
    bf16 = any(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and _route(ops)(w) is not LinearRoute.BLOCKED
               for w in weights)
    if bf16 and ops.streaming_rows(False):
        linear += "; " + STREAMED_BF16_ROWS.format(rows=ops.streaming_rows(False))
    if not all(isinstance(w, torch.Tensor) for w in weights) and ops.streaming_rows(True):
        linear += "; " + STREAMED_QUANTIZED_ROWS.format(rows=ops.streaming_rows(True)) + _past_the_kernel(ops)
        if getattr(ops, "w8a8_rows", 0):
            linear += f" (int8: W8A8 from {ops.w8a8_rows} rows)"
    kind = type(ops).__name__.removesuffix("Ops").lower()
    return (f"{_name(dtype)} on {device}, {kind} kernels: linear layers {linear}; "
            f"attention {ops.attention_backend}; KV cache {_name(kv_dtype)}")


def _past_the_kernel(ops) -> str:
    """What quantized layers do with more rows than the integer kernels take."""
    if getattr(ops, "gemm_copies", False):
        return ", more a bf16 copy kept for the GEMM"
    refused = getattr(ops, "gemm_copies_refused", "")
    return ", more are dequantized" + (f" at every call ({refused})" if refused else "")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
