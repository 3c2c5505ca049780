"""CUDA graphs of decode-only steps: the forward pass and the logits of a step where every
request has one query, launched as one recorded graph instead of hundreds of kernel launches
from Python.

A step of ``n`` decodes runs as the smallest batch-size bucket ``rows >= n``: its inputs are
copied into static buffers shared by every bucket, and the rows past ``n`` are padding that
changes nothing: slot -1 (the KV write skips negative slots) and sequence length 0 (the
attention reads no key for them and writes zeros). Each bucket's function is recorded once, at
start-up, with every row padding (so the recording writes no KV), into one memory pool.

Whatever a recorded graph launches is fixed at recording, host-side decisions included: the
Triton attention is told one query per row and ``max_model_len`` keys, so its grid (one tile
per row) and its number of key splits hold for any step of the bucket; splits past a short
sequence's keys merge as empty.

How a bucket's function is recorded is a strategy: ``GraphCapture`` records CUDA graphs;
``eager_replay`` calls the same function on the same static padded buffers, which is how the
tests check the padding and the bucketing on a machine without a GPU. Steps with a prefill
chunk, drafts or prompt logprobs, and steps past the largest bucket, run eagerly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from travelator.engine.input_batch import StepInputs
from travelator.model.attention import AttentionMetadata
from travelator.model.llama import LlamaModel

StepFn = Callable[[], torch.Tensor]
SMALL_BUCKETS = (1, 2, 4)  # then every BUCKET_STEP rows
BUCKET_STEP = 8
MAX_GRAPH_ROWS = 512  # larger decode steps gain little from a graph and cost its memory


def bucket_sizes(max_rows: int) -> list[int]:
    """The batch sizes recorded: 1, 2, 4, 8, 16, 24, ... up to ``max_rows``, which is one."""
    max_rows = min(max_rows, MAX_GRAPH_ROWS)
    steps = range(BUCKET_STEP, max_rows, BUCKET_STEP)
    return sorted({b for b in (*SMALL_BUCKETS, *steps) if b < max_rows} | {max_rows})


class GraphCapture:
    """Records a bucket's function as a CUDA graph; every bucket's in one memory pool (steps
    run one at a time, and each step reads its logits before the next replay)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: StepFn) -> StepFn:
        # One run outside the recording compiles the Triton kernels and sets up torch's lazy state.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


def eager_replay(fn: StepFn) -> StepFn:
    """The strategy without a GPU: each replay runs the function itself."""
    return fn


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *,
                 max_model_len: int, block_size: int, device: torch.device, buckets: list[int],
                 capture: Callable[[StepFn], StepFn]) -> None:
        self.buckets = sorted(buckets)
        self.max_model_len = max_model_len
        top = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        # Static inputs, every bucket a prefix of them; all padding until a step fills them.
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.long, device=device)
        self.query_start = torch.arange(top + 1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(top, self.max_blocks, dtype=torch.long, device=device)
        self.replays: Counter[int] = Counter()  # bucket -> steps it ran
        # Largest first: the smaller ones reuse its pool's memory.
        self._steps = {rows: capture(self._step_fn(model, kv_caches, rows)) for rows in reversed(self.buckets)}

    def _step_fn(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 rows: int) -> StepFn:
        # One query per row, max_model_len keys: the attention's grid and key splits, fixed.
        # The host lists are the torch path's; the Triton path reads only the tensors.
        meta = AttentionMetadata(
            backend="triton", slot_mapping=self.slots[:rows], query_start=self.query_start[:rows + 1],
            seq_lens=self.seq_lens[:rows], block_tables=self.block_tables[:rows], num_decodes=rows,
            query_lens=[1] * rows, context_lens=[0] * rows, max_query_len=1, max_seq_len=self.max_model_len,
        )
        input_ids, positions = self.input_ids[:rows], self.positions[:rows]

        def step() -> torch.Tensor:
            return model.compute_logits(model(input_ids, positions, kv_caches, meta))

        return step

    def takes(self, inputs: StepInputs) -> bool:
        """Whether the step is one the graphs run: decodes only, each sampled, no prompt
        logprobs or pooled rows (the graphs keep no hidden states), within the largest bucket."""
        meta = inputs.meta
        return (meta.max_query_len == 1 and inputs.logits_indices is None and not inputs.prompt_rows
                and not inputs.pool_spans
                and len(meta.query_lens) <= self.buckets[-1] and meta.block_tables.shape[1] <= self.max_blocks)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The step's logits [n, vocab] (a view of the bucket's output, valid until the next run)."""
        meta = inputs.meta
        n = len(meta.query_lens)
        rows = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Rows a larger step used before are padding again. Table columns past a row's keys
        # are never read, so stale ones stay.
        self.slots[n:rows].fill_(-1)
        self.seq_lens[n:rows].fill_(0)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.replays[rows] += 1
        return self._steps[rows]()[:n]
