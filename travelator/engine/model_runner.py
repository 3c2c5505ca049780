"""The model runner owns every tensor: weights, the paged KV cache, and the flat
batch of each step. It takes the scheduler's step description and returns the
sampled tokens.

It keeps its own copy of each running request's tokens and block table, updated
from the small per-step changes the scheduler sends (and from the tokens it samples
itself), so a step description never carries whole sequences twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from travelator.engine.draft_model import DraftJob, DraftModel
from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.engine.grammar_masks import GrammarMasks
from travelator.engine.request import ends_with_token
from travelator.engine.scheduler_output import (
    PromptLogprobs,
    RunnerOutput,
    SampledToken,
    SchedulerOutput,
)
from travelator.model import kv_layout
from travelator.model.arch import ModelArch
from travelator.model.attention import AttentionMetadata, build_metadata, slot_mapping
from travelator.model.host_memory import retain_freed_memory
from travelator.model.llama import LlamaModel
from travelator.model.loader import ModelSource, WeightIterator
from travelator.model.ops import make_ops
from travelator.model.sampler import SamplingBatch, sample
from travelator.model.tp_group import TPGroup
from travelator.sampling_params import SamplingParams


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

    def sampled_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.logits_indices is None else hidden[self.logits_indices]


class ModelRunner:
    def __init__(self, arch: ModelArch, weights: WeightIterator | None, *, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: torch.device, max_model_len: int, seed: int = 0,
                 eos_token_ids: frozenset[int] = frozenset(), tp: TPGroup | None = None,
                 kernels: str = "auto", batch_invariant: bool = False,
                 grammars: GrammarCompiler | None = None, draft: ModelSource | None = None,
                 quantization: str = "auto", quantization_group_size: int = 128,
                 lm_head_quantization: str = "auto") -> None:
        self.arch = arch
        self.ops = make_ops(kernels, device, batch_invariant=batch_invariant)
        # Structured outputs: masks for constrained rows (on the rank that samples).
        self.grammar = GrammarMasks(grammars, self.ops) if grammars is not None else None
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.eos_token_ids = eos_token_ids
        # Tensor parallelism: this rank's shard of the weights and of the KV heads.
        self.tp_size = tp.size if tp is not None else 1
        if tp is not None and batch_invariant:
            tp.fixed_order_sums = True
        method = None if quantization in ("auto", "none") else quantization
        if method is not None and device.type != "cpu":
            raise ValueError(f"quantization {method} runs on the CPU (the engine's CPU kernels); "
                             f"the device is {device}")
        model = LlamaModel(arch, dtype, max_positions=max_model_len, tp=tp, ops=self.ops,
                           quantization=method, group_size=quantization_group_size,
                           keep_gguf_quants=quantization == "auto" and device.type == "cpu",
                           lm_head_quantization=lm_head_quantization)
        if weights is None:
            model.init_dummy_weights(seed)
        else:
            model.load_weights(weights())
        self.model = model.to(device)
        self.ops.prepare(self.model.linear_weights())
        # Speculative decoding with a draft model: it proposes in this runner, with its own KV
        # cache over the same block ids.
        self.draft = DraftModel(draft, dtype=dtype, kv_dtype=kv_dtype, device=device,
                                max_model_len=max_model_len, ops=self.ops) if draft is not None else None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.states: dict[str, RunnerRequestState] = {}
        # Seconds spent per phase, summed over the run (on CUDA, kernels are asynchronous:
        # forward time then shows up where the host first waits, in "sample").
        self.phase_times: dict[str, float] = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}
        if device.type == "cpu":
            # Each step's activations would otherwise page-fault anew (model/host_memory.py);
            # after loading, so that the loader's freed buffers are not kept.
            retain_freed_memory()

    def kv_bytes_per_block(self, block_size: int) -> int:
        a = self.arch
        draft = self.draft.kv_bytes_per_block(block_size) if self.draft is not None else 0
        return block_size * kv_layout.bytes_per_token(a.num_layers, a.num_kv_heads // self.tp_size, a.head_dim,
                                                     self.kv_dtype) + draft

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        a = self.arch
        shape = kv_layout.cache_shape(num_blocks, block_size, a.num_kv_heads // self.tp_size, a.head_dim,
                                     self.kv_dtype)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(a.num_layers)
        ]
        self.block_size = block_size
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks, block_size)

    # ---- KV hand-off (prefill/decode disaggregation) ---------------------------------
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' K and V in every layer: [layers, 2, len(block_ids), kv heads, block_size, row]
        (row: head_dim, or head_dim + 4 bytes in an int8 cache)."""
        self._check_handoff()
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([torch.stack((k.index_select(0, ids), v.index_select(0, ids)))
                            for k, v in self.kv_caches]).cpu()

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write ``read_kv_blocks``' output (of another engine) into these blocks."""
        self._check_handoff()
        expected = (len(self.kv_caches), 2, len(block_ids), *self.kv_caches[0][0].shape[1:])
        if tuple(data.shape) != expected:
            raise ValueError(f"handed-off KV has shape {tuple(data.shape)}, this pool wants {expected}")
        if data.dtype != self.kv_dtype:
            raise ValueError(f"handed-off KV is {data.dtype}, this pool holds {self.kv_dtype}")
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, ids, data[layer, 0])
            v.index_copy_(0, ids, data[layer, 1])

    def _check_handoff(self) -> None:
        if self.draft is not None:
            raise ValueError("a KV hand-off does not carry a draft model's cache: no draft-model speculation")

    # ---- one step ------------------------------------------------------------------
    def held_request_ids(self) -> set[str]:
        return set(self.states)

    def shutdown(self) -> None:
        """Stop the grammar's background thread; the runner lives in the engine's process."""
        if self.grammar is not None:
            self.grammar.shutdown()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        self._apply_changes(out)
        if out.is_empty:
            return RunnerOutput()
        drafts_of = dict(out.draft_token_ids)
        if out.num_model_drafts:
            drafts_of.update(self._propose_with_draft_model(out.num_model_drafts))
        inputs = self._prepare(out, drafts_of)
        t1 = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if inputs.sampled_ids:
            logits = self.model.compute_logits(inputs.sampled_rows(hidden))
        prompt_logprobs = self.compute_prompt_logprobs(hidden, inputs)
        t2 = time.perf_counter()
        self.phase_times["prepare"] += t1 - t0
        self.phase_times["forward"] += t2 - t1
        if not inputs.sampled_ids:
            return RunnerOutput(prompt_logprobs=prompt_logprobs)
        states = [self.states[rid] for rid in inputs.sampled_ids]
        # Row j of a request with drafts (its rows are consecutive) samples the token after
        # its first j drafts.
        drafted, j = [], 0
        for row, rid in enumerate(inputs.sampled_ids):
            j = j + 1 if row and inputs.sampled_ids[row - 1] == rid else 0
            drafted.append(drafts_of.get(rid, [])[:j])
        batch = SamplingBatch(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] if s.sampling_params.uses_penalties else []
                              for s in states],
            output_token_ids=[s.token_ids[s.num_prompt_tokens:] + d for s, d in zip(states, drafted)],
            eos_token_ids=self.eos_token_ids,
        )
        constrained = [(row, rid, s.sampling_params, batch.output_token_ids[row])
                       for row, (rid, s) in enumerate(zip(inputs.sampled_ids, states))
                       if s.sampling_params.structured is not None]
        if constrained:
            if self.grammar is None:
                raise RuntimeError("a constrained request reached a runner without a grammar compiler")
            self.grammar.apply(logits, constrained)
        result = sample(logits, batch, argmax=self.ops.argmax, race=self.ops.exponential_race)
        sampled: dict[str, SampledToken] = {}
        more: dict[str, list[SampledToken]] = {}
        row = 0
        while row < len(inputs.sampled_ids):
            rid = inputs.sampled_ids[row]
            drafts = drafts_of.get(rid, [])
            s = self.states[rid]
            num_outputs = len(s.token_ids) - s.num_prompt_tokens
            # Keep the drafts up to the first its own sample disagrees with, plus that sample,
            # and nothing after a token that ends the request (EOS, a stop token).
            toks = []
            for j in range(len(drafts) + 1):
                token = result.token_ids[row + j]
                toks.append(SampledToken(
                    token,
                    result.logprobs[row + j] if result.logprobs is not None else None,
                    result.top_logprobs[row + j] if result.top_logprobs is not None else None,
                ))
                if (j == len(drafts) or token != drafts[j]
                        or ends_with_token(s.sampling_params, self.eos_token_ids, token, num_outputs + j + 1)):
                    break
            if rid in out.num_model_drafts:
                self.draft.accepted(rid, len(s.token_ids), len(drafts), len(toks) - 1)
            s.token_ids.extend(t.token_id for t in toks)
            sampled[rid] = toks[0]
            if len(toks) > 1:
                more[rid] = toks[1:]
            row += len(drafts) + 1
        failed = {}
        if constrained:
            failed = self.grammar.advance([(rid, [t.token_id for t in [sampled[rid], *more.get(rid, [])]])
                                           for rid in dict.fromkeys(rid for _, rid, _, _ in constrained)])
        self.phase_times["sample"] += time.perf_counter() - t2
        return RunnerOutput(sampled, prompt_logprobs, more_sampled=more, failed=failed)

    # Rows of prompt logits computed at once: [rows, vocab] float32 stays small.
    PROMPT_LOGITS_ROWS = 256

    def compute_prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, PromptLogprobs]:
        """The log-probability of each prompt token the step's rows predict, and its top
        alternatives. With tensor parallelism every rank runs this (the LM head's gather is
        collective); only the driver gets numbers back."""
        if not inputs.prompt_rows:
            return {}
        rows = torch.tensor(inputs.prompt_rows, dtype=torch.long, device=hidden.device)
        targets = torch.tensor(inputs.prompt_targets, dtype=torch.long, device=hidden.device)
        top_n = max(span[3] for span in inputs.prompt_spans)
        chosen, ranks, top_vals, top_ids = [], [], [], []
        for i in range(0, len(rows), self.PROMPT_LOGITS_ROWS):
            logits = self.model.compute_logits(hidden[rows[i:i + self.PROMPT_LOGITS_ROWS]])
            if logits is None:  # a tensor-parallel worker: its slice went to the driver
                continue
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            picked = logprobs.gather(1, targets[i:i + self.PROMPT_LOGITS_ROWS, None])
            chosen.append(picked.squeeze(1))
            ranks.append((logprobs > picked).sum(dim=-1) + 1)  # 1: the most likely token
            if top_n:
                vals, ids = logprobs.topk(top_n, dim=-1)
                top_vals.append(vals)
                top_ids.append(ids)
        if not chosen:
            return {}
        lp = torch.cat(chosen).tolist()
        rank = torch.cat(ranks).tolist()
        vals = torch.cat(top_vals).tolist() if top_n else None
        ids = torch.cat(top_ids).tolist() if top_n else None
        result, row = {}, 0
        for rid, first, count, n in inputs.prompt_spans:
            tops = [dict(zip(ids[r][:n], vals[r][:n])) if n else {} for r in range(row, row + count)]
            result[rid] = PromptLogprobs(first, lp[row:row + count], tops, rank[row:row + count])
            row += count
        return result

    def _apply_changes(self, out: SchedulerOutput) -> None:
        for rid in out.freed_request_ids:
            self.states.pop(rid, None)
            if self.grammar is not None:
                self.grammar.forget(rid)
            if self.draft is not None:
                self.draft.forget(rid)
        for new in out.new_requests:
            if self.grammar is not None:  # readmitted: its matcher is rebuilt from its outputs
                self.grammar.forget(new.request_id)
            if self.draft is not None:  # readmitted: the draft computes it again
                self.draft.forget(new.request_id)
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

    def _propose_with_draft_model(self, counts: dict[str, int]) -> dict[str, list[int]]:
        jobs = [DraftJob(rid, self.states[rid].token_ids, self.states[rid].block_ids, k) for rid, k in counts.items()]
        return self.draft.propose(jobs)

    def _prepare(self, out: SchedulerOutput, drafts_of: dict[str, list[int]]) -> StepInputs:
        bs = self.block_size
        # Decodes (one query each) first: the torch fallback batches them in one call.
        items = list(out.num_scheduled_tokens.items())
        ordered = [(rid, n) for rid, n in items if n == 1] + [(rid, n) for rid, n in items if n != 1]

        input_ids: list[int] = []
        # Plain lists, one tensor each at the end: per-request numpy arrays cost more than
        # they save at a few tokens per request (decodes), and about the same for chunks.
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampled_ids: list[str] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_spans: list[tuple[str, int, int, int]] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        offset = 0
        for rid, n in ordered:
            s = self.states[rid]
            start = s.num_computed_tokens
            end = start + n
            drafts = drafts_of.get(rid, [])
            assert end == len(s.token_ids) + len(drafts) if drafts else end <= len(s.token_ids), \
                "scheduled past the known tokens"
            input_ids.extend(s.token_ids[start:end] + drafts)
            positions.extend(range(start, end))
            slots.extend(slot_mapping(s.block_ids, start, end, bs))
            query_lens.append(n)
            context_lens.append(start)
            tables.append(s.block_ids[: -(-end // bs)])
            if drafts:  # sample after the last known token and after every draft
                logits_indices.extend(range(offset + n - 1 - len(drafts), offset + n))
                sampled_ids.extend([rid] * (1 + len(drafts)))
            elif end == len(s.token_ids):  # reached the end: sample (docs/design.md invariant 5)
                logits_indices.append(offset + n - 1)
                sampled_ids.append(rid)
            want = s.sampling_params.prompt_logprobs
            # Position p's logits predict token p + 1: prompt tokens 1 .. num_prompt_tokens - 1.
            last = min(end, s.num_prompt_tokens - 1)
            if want is not None and last > start:
                prompt_rows.extend(range(offset, offset + last - start))
                prompt_targets.extend(s.token_ids[start + 1:last + 1])
                prompt_spans.append((rid, start + 1, last - start, want))
            offset += n

        dev = self.device
        meta = build_metadata(self.ops.attention_backend, torch.tensor(slots, dtype=torch.long, device=dev),
                              query_lens, context_lens, tables, bs, dev,
                              tiled_prefill=self.ops.tiled_prefill_attention)
        every_row = len(logits_indices) == offset and logits_indices == list(range(offset))
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            logits_indices=None if every_row else torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampled_ids=sampled_ids,
            prompt_rows=prompt_rows,
            prompt_targets=prompt_targets,
            prompt_spans=prompt_spans,
        )
