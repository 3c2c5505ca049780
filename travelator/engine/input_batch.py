"""The runner's first stage: the persistent batch state and the flat inputs of each step.

The runner keeps its own copy of each running request's tokens and block table, updated from
the small per-step changes the scheduler sends (and from the tokens it keeps after sampling),
so a step description never carries whole sequences twice. ``prepare`` turns a step into the
flat batch the forward pass takes: token ids, positions, attention metadata, and which rows'
logits are sampled or give prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from travelator.engine.scheduler_output import SchedulerOutput
from travelator.model.attention import AttentionMetadata, build_metadata, slot_mapping
from travelator.model.ops import TorchOps
from travelator.sampling_params import SamplingParams

if TYPE_CHECKING:
    from travelator.engine.step_staging import StepStaging


@dataclass(slots=True)
class RunnerRequestState:
    request_id: str
    num_prompt_tokens: int
    token_ids: list[int]  # prompt + output
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Rows of the flat batch whose logits are sampled; None: every row, in order (a step of
    # decodes only), so no gather is needed.
    logits_indices: torch.Tensor | None
    sampled_ids: list[str]  # request ids in logits_indices order (repeated: one per draft too)
    # Prompt logprobs: the rows whose logits predict a prompt token, those tokens, and per
    # request (id, index of its first predicted prompt token, count, top alternatives).
    prompt_rows: list[int]
    prompt_targets: list[int]
    prompt_spans: list[tuple[str, int, int, int]]
    # Pooling requests' rows: (id, first row, count, whether its prompt ends in them); the
    # last prompt row only, unless every row is pooled (a mean).
    pool_spans: list[tuple[str, int, int, bool]] = field(default_factory=list)

    def sampled_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.logits_indices is None else hidden[self.logits_indices]


@dataclass(slots=True)
class _FlatBatch:
    """The lists ``prepare`` fills, one tensor each at the end: per-request numpy arrays cost
    more than they save at a few tokens per request (decodes), and about the same for chunks."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    logits_indices: list[int]
    sampled_ids: list[str]
    prompt_rows: list[int]
    prompt_targets: list[int]
    prompt_spans: list[tuple[str, int, int, int]]
    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[int]]
    pool_spans: list[tuple[str, int, int, bool]]

    @classmethod
    def empty(cls) -> _FlatBatch:
        return cls([], [], [], [], [], [], [], [], [], [], [], [])


class InputBatch:
    def __init__(self, ops: TorchOps, device: torch.device, staging: StepStaging | None = None) -> None:
        self.ops = ops
        self.device = device
        self.staging = staging  # on CUDA: the step's tensors through persistent pinned buffers
        self.block_size = 0
        self.states: dict[str, RunnerRequestState] = {}

    def apply_changes(self, out: SchedulerOutput) -> list[str]:
        """Apply the step's changes; returns the ids whose other per-request state (a grammar
        matcher, a draft model's progress) must go: freed, or (re)admitted in full."""
        for rid in out.freed_request_ids:
            self.states.pop(rid, None)
        for new in out.new_requests:
            self.states[new.request_id] = RunnerRequestState(
                new.request_id,
                len(new.prompt_token_ids),
                new.prompt_token_ids + new.output_token_ids,
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
            )
        for c in out.cached_requests:
            s = self.states[c.request_id]
            s.block_ids.extend(c.new_block_ids)
            s.num_computed_tokens = c.num_computed_tokens
        return [*out.freed_request_ids, *(new.request_id for new in out.new_requests)]

    def append(self, request_id: str, token_ids: list[int]) -> None:
        """Tokens the request kept after sampling (here, or on the driver's rank)."""
        self.states[request_id].token_ids.extend(token_ids)

    def prepare(self, out: SchedulerOutput, drafts_of: dict[str, list[int]]) -> StepInputs:
        # Decodes (one query each) first: the torch fallback batches them in one call.
        items = list(out.num_scheduled_tokens.items())
        ordered = [(rid, n) for rid, n in items if n == 1] + [(rid, n) for rid, n in items if n != 1]
        flat = _FlatBatch.empty()
        offset = 0
        for rid, n in ordered:
            self._add(flat, self.states[rid], n, offset, drafts_of.get(rid, []))
            offset += n
        if self.staging is not None:
            every_row = flat.logits_indices == list(range(offset))
            return self.staging.stage(flat, every_row, self.block_size, self.ops.attention_backend,
                                      self.ops.tiled_prefill_attention)
        dev = self.device
        meta = build_metadata(self.ops.attention_backend, torch.tensor(flat.slots, dtype=torch.long, device=dev),
                              flat.query_lens, flat.context_lens, flat.tables, self.block_size, dev,
                              tiled_prefill=self.ops.tiled_prefill_attention)
        every_row = len(flat.logits_indices) == offset and flat.logits_indices == list(range(offset))
        return StepInputs(
            input_ids=torch.tensor(flat.input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(flat.positions, dtype=torch.long, device=dev),
            meta=meta,
            logits_indices=None if every_row else torch.tensor(flat.logits_indices, dtype=torch.long, device=dev),
            sampled_ids=flat.sampled_ids,
            prompt_rows=flat.prompt_rows,
            prompt_targets=flat.prompt_targets,
            prompt_spans=flat.prompt_spans,
            pool_spans=flat.pool_spans,
        )

    def _add(self, flat: _FlatBatch, s: RunnerRequestState, n: int, offset: int, drafts: list[int]) -> None:
        """Add ``n`` query tokens of one request (its last ones the drafts, if any) at row ``offset``."""
        bs = self.block_size
        rid = s.request_id
        start = s.num_computed_tokens
        end = start + n
        assert end == len(s.token_ids) + len(drafts) if drafts else end <= len(s.token_ids), \
            "scheduled past the known tokens"
        flat.input_ids.extend(s.token_ids[start:end] + drafts)
        flat.positions.extend(range(start, end))
        flat.slots.extend(slot_mapping(s.block_ids, start, end, bs))
        flat.query_lens.append(n)
        flat.context_lens.append(start)
        flat.tables.append(s.block_ids[: -(-end // bs)])
        if drafts:  # sample after the last known token and after every draft
            flat.logits_indices.extend(range(offset + n - 1 - len(drafts), offset + n))
            flat.sampled_ids.extend([rid] * (1 + len(drafts)))
        elif end == len(s.token_ids):  # reached the end: sample (docs/design.md invariant 5)
            flat.logits_indices.append(offset + n - 1)
            flat.sampled_ids.append(rid)
        want = s.sampling_params.prompt_logprobs
        # Position p's logits predict token p + 1: prompt tokens 1 .. num_prompt_tokens - 1.
        last = min(end, s.num_prompt_tokens - 1)
        if want is not None and last > start:
            flat.prompt_rows.extend(range(offset, offset + last - start))
            flat.prompt_targets.extend(s.token_ids[start + 1:last + 1])
            flat.prompt_spans.append((rid, start + 1, last - start, want))
        pooling = s.sampling_params.pooling
        if pooling is not None:
            final = end == len(s.token_ids)
            if pooling.needs_every_prompt_row:
                flat.pool_spans.append((rid, offset, n, final))
            elif final:
                flat.pool_spans.append((rid, offset + n - 1, 1, True))
