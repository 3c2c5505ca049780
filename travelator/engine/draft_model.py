"""Speculative decoding's draft-model proposer: a smaller model of the same vocabulary that
proposes a request's next tokens greedily, inside the model runner.

Its KV cache has as many blocks as the target's and is indexed by the same block tables: the
block manager allocates one block id for both, so the draft needs no bookkeeping of its own
beyond, per request, how many of its tokens the draft has computed. When a request is to
verify k drafts, the draft model first computes the request's tokens it has not seen (the
whole prompt the first time, then the one or two tokens the last step added), whose last
logits give the first draft, then k - 1 one-token steps give the rest; every request drafting
in the step shares each of these forward passes. Drafts the target refuses leave stale KV in
the draft's cache past what it counts as computed: it is overwritten when those positions are
computed again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from travelator.model import kv_layout
from travelator.model.attention import build_metadata, slot_mapping
from travelator.model.device import building_on
from travelator.model.llama import LlamaModel
from travelator.model.loader import ModelSource
from travelator.model.ops import TorchOps


# Most tokens in one pass of the draft model: catching up a long prompt takes several.
MAX_PASS_TOKENS = 1024


@dataclass(slots=True)
class DraftJob:
    """One request that drafts this step."""
    request_id: str
    token_ids: list[int]  # all its known tokens
    block_ids: list[int]
    num_drafts: int


class DraftModel:
    def __init__(self, source: ModelSource, *, dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device, max_model_len: int, ops: TorchOps) -> None:
        self.arch = source.arch
        self.ops = ops
        self.device = device
        self.kv_dtype = kv_dtype
        with building_on(device):  # on an accelerator, never whole on the host
            model = LlamaModel(source.arch, dtype, max_positions=max_model_len, ops=ops)
        if source.weights is None:
            model.init_dummy_weights(1)  # not the target's seed: another random model
        else:
            model.load_weights(source.weights(), source=source.name)
        self.model = model.to(device)
        ops.prepare(self.model.linear_weights(), dtype)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self._computed: dict[str, int] = {}  # request id -> tokens whose KV the draft holds

    def kv_bytes_per_block(self, block_size: int) -> int:
        a = self.arch
        return block_size * kv_layout.bytes_per_token(a.num_layers, a.num_kv_heads, a.head_dim, self.kv_dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        a = self.arch
        shape = kv_layout.cache_shape(num_blocks, block_size, a.num_kv_heads, a.head_dim, self.kv_dtype)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                          for _ in range(a.num_layers)]
        self.block_size = block_size

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, jobs: list[DraftJob]) -> dict[str, list[int]]:
        """Greedy drafts for every job."""
        drafts: dict[str, list[int]] = {job.request_id: [] for job in jobs}
        # First: what each request's draft has not computed yet, up to its last token (the
        # whole prompt after a prefix-cache hit or a readmission), in passes of at most
        # MAX_PASS_TOKENS tokens; the argmax after the last token is the first draft.
        spans = []
        for job in jobs:
            start = min(self._computed.get(job.request_id, 0), len(job.token_ids) - 1)
            while len(job.token_ids) - start > MAX_PASS_TOKENS:
                self._forward([(job, start, job.token_ids[start:start + MAX_PASS_TOKENS])])
                start += MAX_PASS_TOKENS
            spans.append((job, start, job.token_ids[start:]))
        group: list[tuple[DraftJob, int, list[int]]] = []
        for i, span in enumerate(spans):
            group.append(span)
            if i == len(spans) - 1 or sum(len(t) for _, _, t in group) + len(spans[i + 1][2]) > MAX_PASS_TOKENS:
                for (job, _, _), token in zip(group, self._forward(group)):
                    drafts[job.request_id].append(token)
                group = []
        for job in jobs:
            self._computed[job.request_id] = len(job.token_ids)
        # Then one token at a time, for those that want more.
        for j in range(1, max(job.num_drafts for job in jobs)):
            more = [job for job in jobs if job.num_drafts > j]
            steps = [(job, len(job.token_ids) + j - 1, [drafts[job.request_id][-1]]) for job in more]
            for job, token in zip(more, self._forward(steps)):
                drafts[job.request_id].append(token)
        return drafts

    def accepted(self, request_id: str, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        """The target kept ``num_accepted`` of the request's drafts: the draft's KV of the
        drafts it had as input (all but the last) is valid up to there."""
        self._computed[request_id] = num_tokens_before + min(num_accepted, num_drafts - 1)

    def _forward(self, spans: list[tuple[DraftJob, int, list[int]]]) -> list[int]:
        """One forward pass over (job, first position, tokens) spans, decodes first; the
        argmax after each span's last token, in the order given."""
        order = sorted(range(len(spans)), key=lambda i: len(spans[i][2]) != 1)
        bs = self.block_size
        input_ids, positions, slots, query_lens, context_lens, tables, last = [], [], [], [], [], [], []
        for i in order:
            job, start, tokens = spans[i]
            end = start + len(tokens)
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(slot_mapping(job.block_ids, start, end, bs))
            query_lens.append(len(tokens))
            context_lens.append(start)
            tables.append(job.block_ids[: -(-end // bs)])
            last.append(len(input_ids) - 1)
        dev = self.device
        meta = build_metadata(self.ops.attention_backend, torch.tensor(slots, dtype=torch.long, device=dev),
                              query_lens, context_lens, tables, bs, dev)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), self.kv_caches, meta)
        picks = self.ops.argmax(self.model.compute_logits(hidden[torch.tensor(last, device=dev)])).tolist()
        out = [0] * len(spans)
        for slot, i in enumerate(order):
            out[i] = picks[slot]
        return out
