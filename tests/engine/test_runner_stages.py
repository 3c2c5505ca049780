"""The model runner's stages apart: input preparation (``InputBatch``) and the acceptance of
drafts (``accept_drafts``); and no code probes the runner for what it may have."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from travelator.engine.input_batch import InputBatch
from travelator.engine.sampling_stage import accept_drafts
from travelator.engine.scheduler_output import NewRequestData, SchedulerOutput
from travelator.model.ops import make_ops
from travelator.model.sampler import SamplerOutput
from travelator.sampling_params import SamplingParams

PACKAGE = Path(__file__).resolve().parents[2] / "travelator"


def test_accept_drafts_keeps_agreeing_drafts_then_the_own_sample():
    # "a": drafts [5, 6, 7], its rows sample 5, 6, 9, 4 -> 5, 6, then its own 9.
    # "b": no drafts -> its one sample. "c": drafts [3], both agree -> 3, then the bonus 8.
    ids = ["a"] * 4 + ["b"] + ["c"] * 2
    result = SamplerOutput([5, 6, 9, 4, 11, 3, 8], None, None)
    kept = accept_drafts(ids, {"a": [5, 6, 7], "c": [3]}, result)
    assert {rid: [t.token_id for t in toks] for rid, toks in kept.items()} == {
        "a": [5, 6, 9], "b": [11], "c": [3, 8]}


def _new(rid: str, prompt: list[int], computed: int) -> NewRequestData:
    return NewRequestData(rid, prompt, [], SamplingParams(), [0, 1], computed)


def test_input_batch_puts_decodes_first_and_samples_at_the_end_and_after_drafts():
    batch = InputBatch(make_ops("torch", torch.device("cpu")), torch.device("cpu"))
    batch.block_size = 4
    out = SchedulerOutput(new_requests=[_new("chunk", list(range(10, 16)), 0), _new("dec", [1, 2, 3], 2)],
                          num_scheduled_tokens={"chunk": 4, "dec": 1})
    assert batch.apply_changes(out) == ["chunk", "dec"]
    inputs = batch.prepare(out, {})
    assert inputs.input_ids.tolist() == [3, 10, 11, 12, 13]  # the decode first
    assert inputs.positions.tolist() == [2, 0, 1, 2, 3]
    assert inputs.sampled_ids == ["dec"]  # the chunk stops short of its prompt's end
    assert inputs.logits_indices.tolist() == [0]
    batch.append("dec", [7])
    drafting = SchedulerOutput(num_scheduled_tokens={"dec": 3})
    batch.states["dec"].num_computed_tokens = 3
    inputs = batch.prepare(drafting, {"dec": [8, 9]})
    assert inputs.input_ids.tolist() == [7, 8, 9] and inputs.sampled_ids == ["dec"] * 3
    assert inputs.logits_indices is None  # every row samples


def test_nothing_probes_the_runner():
    probe = re.compile(r"\b(hasattr|getattr)\([^)]*runner")
    found = [f"{p.relative_to(PACKAGE)}:{n}" for p in PACKAGE.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert not found, found
