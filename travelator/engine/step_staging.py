"""Step inputs on a CUDA device: written into one persistent pinned host buffer and copied to
one persistent device buffer with a single asynchronous copy, instead of one
``torch.tensor(list, device=cuda)`` (a pageable, synchronous copy each) per tensor.

Each step packs its tensors back to back from the start of the buffer: input ids, positions,
slots, logits indices, query starts, sequence lengths, and the block tables as a [B, width]
block (width: the step's widest table). The tensors the step gets are views of the device
buffer; the next step writes the host buffer again only once the previous copy is done, and
overwrites the device buffer only after the previous step's kernels (the same stream) read it.
The CPU keeps ``InputBatch``'s own path.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from travelator.engine.input_batch import StepInputs, _FlatBatch
from travelator.model.attention import AttentionMetadata


class StepStaging:
    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_blocks: int) -> None:
        self.device = device
        # Room for a step of max_tokens tokens over max_seqs requests with full-length tables;
        # a larger one (drafts, a wider table) grows the buffers once.
        self._allocate(4 * max_tokens + 2 * max_seqs + 1 + max_seqs * max_blocks)
        self._copied: torch.cuda.Event | None = None

    def _allocate(self, size: int) -> None:
        # Pinned on CUDA (an asynchronous copy needs it); a CPU device (tests) stages the same way.
        self.host = torch.empty(size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.host_np = self.host.numpy()
        self.dev = torch.empty(size, dtype=torch.long, device=self.device)

    def stage(self, flat: _FlatBatch, every_row: bool, block_size: int, backend: str,
              tiled_prefill: bool) -> StepInputs:
        tokens, seqs = len(flat.input_ids), len(flat.query_lens)
        width = max(len(t) for t in flat.tables)
        n_logits = 0 if every_row else len(flat.logits_indices)
        used = 3 * tokens + n_logits + 2 * seqs + 1 + seqs * width
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        if used > self.host.numel():
            self._allocate(2 * used)
        seq_lens = [c + n for c, n in zip(flat.context_lens, flat.query_lens)]
        h = self.host_np
        spans = _spans(tokens, tokens, tokens, n_logits, seqs + 1, seqs, seqs * width)
        (ids, pos, slots, logits, qs, lens, tables) = spans
        h[ids] = flat.input_ids
        h[pos] = flat.positions
        h[slots] = flat.slots
        if n_logits:
            h[logits] = flat.logits_indices
        h[qs.start] = 0
        np.cumsum(flat.query_lens, out=h[qs.start + 1:qs.stop])
        h[lens] = seq_lens
        table = h[tables].reshape(seqs, width)
        for row, t in zip(table, flat.tables):
            row[:len(t)] = t
            row[len(t):] = 0
        self.dev[:used].copy_(self.host[:used], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        d = self.dev
        meta = _metadata(backend, d, spans, flat, seq_lens, width, block_size, tiled_prefill)
        return StepInputs(
            input_ids=d[ids], positions=d[pos], meta=meta,
            logits_indices=None if every_row else d[logits],
            sampled_ids=flat.sampled_ids, prompt_rows=flat.prompt_rows,
            prompt_targets=flat.prompt_targets, prompt_spans=flat.prompt_spans,
            pool_spans=flat.pool_spans,
        )


def _spans(*sizes: int) -> list[slice]:
    """Consecutive slices of the given sizes from 0."""
    ends = list(itertools.accumulate(sizes))
    return [slice(end - size, end) for size, end in zip(sizes, ends)]


def _metadata(backend, dev: torch.Tensor, spans: list[slice], flat: _FlatBatch, seq_lens: list[int],
              width: int, block_size: int, tiled_prefill: bool) -> AttentionMetadata:
    """The metadata ``build_metadata`` makes, over the staged tensors."""
    _, _, slots, _, qs, lens, tables = spans
    seqs = len(flat.query_lens)
    num_decodes = next((i for i, n in enumerate(flat.query_lens) if n != 1), seqs)
    decode_mask = None
    if backend == "torch" and num_decodes:  # as build_metadata: the decodes' widest table
        decode_width = max(len(t) for t in flat.tables[:num_decodes])
        positions = torch.arange(decode_width * block_size, device=dev.device)
        decode_mask = (positions.unsqueeze(0) < dev[lens][:num_decodes].unsqueeze(1))[:, None, None, :]
    return AttentionMetadata(
        backend=backend, slot_mapping=dev[slots], query_start=dev[qs], seq_lens=dev[lens],
        block_tables=dev[tables].view(seqs, width), num_decodes=num_decodes,
        query_lens=flat.query_lens, context_lens=flat.context_lens,
        max_query_len=max(flat.query_lens), max_seq_len=max(seq_lens),
        decode_mask=decode_mask, tiled_prefill=tiled_prefill,
    )
