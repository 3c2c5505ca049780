"""A bad input to every native op, each of which must raise RuntimeError in Python.

Run as a script (tests/kernels/test_native_errors.py runs it in a subprocess, so that a crash
fails one test instead of killing pytest): it names each case before calling it, then prints
``raised <case>: <message>``, so that a process killed by a signal shows which call it was.
Exit status 1 where a case raised something else or did not raise, or where an op the build
registers has no case here.

``--library PATH`` loads that build instead of travelator's (a test build of a kernel file),
and runs the cases of the ops it registers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

ops = torch.ops.travelator
TILE = 64  # quant_common.h's kTileRows


def _paged_attention():
    q, cache = torch.zeros(1, 2, 8), torch.zeros(1, 1, 4, 8)
    index = torch.zeros(1, dtype=torch.long)
    ops.paged_attention(q, cache, cache, torch.tensor([0, 1]), index, index.view(1, 1), 1.0, False, -1)


def _decoder_layers():  # no layers: the lists are inconsistent
    x, t = torch.zeros(1, 8), torch.zeros(1, dtype=torch.long)
    ops.decoder_layers(x, t, torch.zeros(4, 4), torch.zeros(4, 4), t, t, t, t, [x], [], [], [], [], [], [],
                       2, 1, 4, 1e-5, 1.0, False)


def _quant_x():
    return torch.zeros(1, 128, dtype=torch.bfloat16)


def _packed(k_quads: int) -> torch.Tensor:
    return torch.zeros(1, k_quads, 4, TILE, dtype=torch.uint8)


CASES: dict[str, Callable[[], object]] = {
    "paged_attention": _paged_attention,  # a negative window
    "decoder_layers": _decoder_layers,
    "rms_norm": lambda: ops.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-5),
    "add_rms_norm_": lambda: ops.add_rms_norm_(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5),
    "head_rms_norm_": lambda: ops.head_rms_norm_(torch.zeros(2, 8), torch.ones(8), 1e-5),
    "silu_and_mul": lambda: ops.silu_and_mul(torch.zeros(2, 7)),
    "gelu_tanh_and_mul": lambda: ops.gelu_tanh_and_mul(torch.zeros(2, 7)),
    "rope_": lambda: ops.rope_(torch.zeros(1, 2, 16), torch.zeros(1, 1, 16), torch.tensor([8]),
                               torch.zeros(8, 8), torch.zeros(8, 8)),  # a position past the table
    "write_kv_": lambda: ops.write_kv_(torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8), torch.tensor([0, 8]),
                                       torch.zeros(2, 1, 8), torch.zeros(2, 1, 8)),  # slot 8 of 8
    "argmax_rows": lambda: ops.argmax_rows(torch.zeros(3, 0)),
    "exponential_race": lambda: ops.exponential_race(torch.zeros(2, 8), torch.zeros(3, dtype=torch.long)),
    "apply_token_bitmask_": lambda: ops.apply_token_bitmask_(torch.zeros(2, 8), torch.zeros(1, 1, dtype=torch.int32),
                                                             torch.tensor([2])),  # row 2 of 2
    "small_m_linear": lambda: ops.small_m_linear(torch.zeros(1, 8, dtype=torch.bfloat16),
                                                 torch.zeros(4, 9, dtype=torch.bfloat16)),
    # An expert id past the experts given.
    "moe_experts": lambda: ops.moe_experts(torch.zeros(1, 8, dtype=torch.bfloat16), torch.tensor([[3]]),
                                           [torch.zeros(4, 8, dtype=torch.bfloat16), None, None,
                                            torch.zeros(8, 2, dtype=torch.bfloat16), None, None], [0, 0, 4, 0, 0, 8]),
    "blocked_linear": lambda: ops.blocked_linear(torch.zeros(1, 8), torch.zeros(1, 4, TILE, 2), None),
    # A weight in its natural layout, not in panels.
    "panel_linear": lambda: ops.panel_linear(torch.zeros(1, 8, dtype=torch.bfloat16),
                                             torch.zeros(16, 8, dtype=torch.bfloat16), None),
    "quant_linear_int8": lambda: ops.quant_linear_int8(_quant_x(), _packed(32), torch.zeros(TILE - 1), TILE),
    "quant_linear_int4": lambda: ops.quant_linear_int4(_quant_x(), _packed(16), torch.zeros(1, 1, 2, TILE), 0,
                                                       TILE),  # group 0
    "quant_linear_w8a8": lambda: ops.quant_linear_w8a8(_quant_x(), _packed(32), torch.zeros(TILE), torch.zeros(3),
                                                       TILE),  # bias of 3 for 64 outputs
    "quant_dequantize_int8": lambda: ops.quant_dequantize_int8(_packed(32), torch.zeros(TILE - 1),
                                                               torch.zeros(128, TILE)),  # short scales
    "quant_dequantize_int4": lambda: ops.quant_dequantize_int4(_packed(16), torch.zeros(1, 1, 2, TILE), 0,
                                                               torch.zeros(128, TILE)),  # group 0
}
NO_INPUTS = {"small_m_linear_rows", "blocked_linear_amx_k_multiple", "attention_flash_route"}


def registered() -> set[str]:
    return {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("travelator::")}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--library"]:
        torch.ops.load_library(argv[1])
    else:
        from travelator import kernels

        kernels.load()
    names = registered() - NO_INPUTS
    failed = sorted(names - CASES.keys())
    for name in failed:
        print(f"no case for {name}")
    for name in sorted(names & CASES.keys()):
        print(f"calling {name}", flush=True)
        try:
            CASES[name]()
        except RuntimeError as exc:
            print(f"raised {name}: {str(exc).splitlines()[0]}", flush=True)
            continue
        except Exception as exc:  # noqa: BLE001 - reported, then the run fails
            print(f"{name} raised {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"{name} did not raise", flush=True)
        failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
