"""What ``dtype="auto"`` picks: bfloat16 wherever it is the faster format, float32 kept for
float32 checkpoints and for torch's own kernels on CPUs without a bf16 GEMM."""

from __future__ import annotations

from unittest import mock

import torch

from travelator.model import device as device_module
from travelator.model.device import resolve_dtype

CPU = torch.device("cpu")


def test_auto_is_bf16_on_every_cpu_the_native_kernels_run_on():
    # An AVX2 machine: no bf16 in hardware, but the native kernels store bf16 and compute in
    # float32, reading half the bytes.
    with mock.patch.object(device_module, "cpu_has_native_bf16", return_value=False):
        assert resolve_dtype("auto", "bfloat16", CPU, native_cpu_kernels=True) is torch.bfloat16
        assert resolve_dtype("auto", None, CPU, native_cpu_kernels=True) is torch.bfloat16
        # torch's own bf16 matmul is the slow one there: float32 without the native kernels.
        assert resolve_dtype("auto", "bfloat16", CPU, native_cpu_kernels=False) is torch.float32
    with mock.patch.object(device_module, "cpu_has_native_bf16", return_value=True):
        assert resolve_dtype("auto", "bfloat16", CPU, native_cpu_kernels=False) is torch.bfloat16


def test_auto_keeps_a_float32_checkpoint_and_an_explicit_dtype():
    assert resolve_dtype("auto", "float32", CPU, native_cpu_kernels=True) is torch.float32
    assert resolve_dtype("float32", "bfloat16", CPU, native_cpu_kernels=True) is torch.float32
    assert resolve_dtype("bfloat16", "float32", CPU, native_cpu_kernels=False) is torch.bfloat16


def test_the_start_up_line_names_the_dtype_and_routes(capsys):
    """LLM prints, once, what the defaults chose: the dtype and each linear route."""
    from travelator import LLM, kernels

    llm = LLM("dummy:llama-50m", num_kv_blocks=64, max_model_len=256)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("travelator: model dummy:llama-50m")]
    assert len(lines) == 1
    if kernels.available():
        assert llm.engine.dtype is torch.bfloat16 and "bfloat16 on cpu, native kernels" in lines[0]
        assert "33 " in lines[0] and "attention native" in lines[0]
