"""How a linear layer's weight is multiplied, decided once when the weight is prepared.

The names and values are ``csrc/linear_route.h``'s (the native layer stack reads them as
integers); a test checks that the two agree. A weight with no route (not prepared: a GPU,
no oneDNN, float16) runs through ``F.linear`` as it was loaded.
"""

from __future__ import annotations

from enum import IntEnum


class LinearRoute(IntEnum):
    # bf16 weight with a oneDNN-packed bf16 copy; a few rows stream it through small_m_linear.
    ONEDNN_BF16 = 0
    # int8 weight (quant_linear_int8 up to its rows, else dequantized).
    INT8 = 1
    # int4 weight (quant_linear_int4 up to its rows, else dequantized).
    INT4 = 2
    # bf16 weight laid out for blocked_linear, at every row count.
    BLOCKED = 3
    # bf16 weight with a oneDNN-packed float32 copy (no bf16 GEMM on this CPU; a few rows
    # stream as ONEDNN_BF16), or a float32 weight with its packed copy.
    ONEDNN_FLOAT32 = 4
    # int4 weight whose codes are e2m1 (MXFP4): as INT4, the codes through their fp4 levels.
    INT4_FP4 = 5
    # bf16 weight laid out in 16-column panels for panel_linear (AVX2 machines: float32 sums,
    # no bf16 GEMM), at every row count: a few rows stream the panels.
    PANELS = 6

    @property
    def quantized(self) -> bool:
        return self in (LinearRoute.INT8, LinearRoute.INT4, LinearRoute.INT4_FP4)

    @property
    def onednn(self) -> bool:
        return self in (LinearRoute.ONEDNN_BF16, LinearRoute.ONEDNN_FLOAT32)


# How the engine's start-up line (model/run_summary.py) names the most rows of a step that
# stream their weights: past them a step's linear layers take the GEMM, and the layers run in
# Python instead of one native call (model/layer_stack.py). The simulator's fitted step cost
# reads the switch back from that line (sim/profiling.py ``route_switch_rows``).
STREAMED_BF16_ROWS = "steps of up to {rows} rows stream the bf16 weights"
STREAMED_QUANTIZED_ROWS = "the integer kernels take up to {rows} rows"
