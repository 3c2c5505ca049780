"""What ``dtype="auto"`` picks: bfloat16 wherever it is the faster format, whatever the
checkpoint holds; float32 for torch's own kernels on CPUs without a bf16 GEMM."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from paths import STORIES, needs_stories

from travelator.model import device as device_module
from travelator.model.device import resolve_dtype

CPU = torch.device("cpu")


def test_auto_is_bf16_on_every_cpu_the_native_kernels_run_on():
    # An AVX2 machine: no bf16 in hardware, but the native kernels store bf16 and compute in
    # float32, reading half the bytes.
    with mock.patch.object(device_module, "cpu_has_native_bf16", return_value=False):
        assert resolve_dtype("auto", CPU, native_cpu_kernels=True) is torch.bfloat16
        # torch's own bf16 matmul is the slow one there: float32 without the native kernels.
        assert resolve_dtype("auto", CPU, native_cpu_kernels=False) is torch.float32
    with mock.patch.object(device_module, "cpu_has_native_bf16", return_value=True):
        assert resolve_dtype("auto", CPU, native_cpu_kernels=False) is torch.bfloat16


def test_an_explicit_dtype_is_kept():
    assert resolve_dtype("float32", CPU, native_cpu_kernels=True) is torch.float32
    assert resolve_dtype("bfloat16", CPU, native_cpu_kernels=False) is torch.bfloat16


@needs_stories
def test_auto_holds_a_float32_checkpoint_in_bf16_and_says_so(capsys):
    """A float32 checkpoint (here a GGUF of float32 tensors) is served in bf16 by default,
    as vLLM serves one in half precision; the start-up line says so and how to keep float32."""
    from travelator import LLM, kernels

    if not kernels.available():
        pytest.skip("without the native kernels auto is bf16 only where the CPU has bf16")
    llm = LLM(str(STORIES), num_kv_blocks=64, max_model_len=256)
    assert llm.engine.dtype is torch.bfloat16
    assert "the checkpoint's float32 weights held in bfloat16 (--dtype float32 keeps them)" in capsys.readouterr().err
    kept = LLM(str(STORIES), dtype="float32", num_kv_blocks=64, max_model_len=256)
    assert kept.engine.dtype is torch.float32 and "weights held in" not in capsys.readouterr().err


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
