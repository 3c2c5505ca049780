"""Staged step inputs (``engine/step_staging.py``, the CUDA path) hold the same tensors and
metadata as the per-tensor path the CPU keeps. On the CPU staged through an unpinned buffer
(the packing is the same); the pinned buffer and its asynchronous copy run in the case marked
``cuda``."""

from __future__ import annotations

import os

import pytest
import torch

from travelator.engine.input_batch import InputBatch
from travelator.engine.scheduler_output import NewRequestData, SchedulerOutput
from travelator.engine.step_staging import StepStaging
from travelator.model.ops import make_ops
from travelator.sampling_params import SamplingParams



def _batches(kernels: str, staging: StepStaging) -> tuple[InputBatch, InputBatch]:
    out = []
    for s in (None, staging):
        batch = InputBatch(make_ops(kernels, staging.device), staging.device, s)
        batch.block_size = 4
        out.append(batch)
    return out[0], out[1]


def _new(rid: str, prompt: list[int], blocks: list[int], computed: int, **params) -> NewRequestData:
    return NewRequestData(rid, prompt, [], SamplingParams(**params), blocks, computed)


def _assert_same(got, want) -> None:
    for name in ("input_ids", "positions", "logits_indices", "sampled_ids", "prompt_rows",
                 "prompt_targets", "prompt_spans"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a.tolist() if isinstance(a, torch.Tensor) else a) == \
            (b.tolist() if isinstance(b, torch.Tensor) else b), name
    for name in ("backend", "slot_mapping", "query_start", "seq_lens", "block_tables", "num_decodes",
                 "query_lens", "context_lens", "max_query_len", "max_seq_len", "decode_mask", "tiled_prefill"):
        a, b = getattr(got.meta, name), getattr(want.meta, name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
        else:
            assert a == b, name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_staged_inputs_equal_the_per_tensor_inputs(kernels, device):
    # Room for a step of 2 tokens over 1 request: the first step grows the buffers.
    if kernels == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path runs on the CPU under Triton's interpreter only")
    staging = StepStaging(torch.device(device), max_tokens=2, max_seqs=1, max_blocks=1)
    plain, staged = _batches(kernels, staging)
    first = SchedulerOutput(
        new_requests=[_new("chunk", list(range(10, 20)), [4, 2, 7], 0, prompt_logprobs=1),
                      _new("dec", [1, 2, 3, 4, 5], [6, 1], 4), _new("spec", [7, 8, 9], [3, 5], 2)],
        num_scheduled_tokens={"chunk": 6, "dec": 1, "spec": 3})
    steps = [(first, {"spec": [30, 31]}),
             (SchedulerOutput(num_scheduled_tokens={"dec": 1}), {})]  # smaller: a prefix of the buffers
    for out, drafts in steps:
        for batch in (plain, staged):
            batch.apply_changes(out)
            if out is not first:
                batch.states["dec"].num_computed_tokens = 5
                batch.append("dec", [9])
        _assert_same(staged.prepare(out, drafts), plain.prepare(out, drafts))
