"""The runner's last stage: from the forward pass's hidden states to the tokens each request
keeps. Logits of the sampled rows, grammar masks of constrained rows, the sample, and the
acceptance of drafts (speculative decoding); also the prompt logprobs asked for.

Whether a request stops among its tokens is not decided here (``OutputProcessor`` does, after
detokenizing): a request keeps its drafts up to the first its own sample disagrees with, and
that sample.
"""

from __future__ import annotations

import torch

from travelator.engine.grammar_masks import GrammarMasks
from travelator.engine.input_batch import RunnerRequestState, StepInputs
from travelator.engine.scheduler_output import PromptLogprobs, SampledToken
from travelator.model.llama import LlamaModel
from travelator.model.ops import TorchOps
from travelator.model.sampler import SamplerOutput, SamplingBatch, sample


class SamplingStage:
    # Rows of prompt logits computed at once: [rows, vocab] float32 stays small.
    PROMPT_LOGITS_ROWS = 256

    def __init__(self, model: LlamaModel, ops: TorchOps, grammar: GrammarMasks | None,
                 eos_token_ids: frozenset[int]) -> None:
        self.model = model
        self.ops = ops
        self.grammar = grammar
        self.eos_token_ids = eos_token_ids

    def logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """The sampled rows' logits; None when no row samples, and on a tensor-parallel worker
        (its vocabulary slice goes to the driver: every rank calls this)."""
        if not inputs.sampled_ids:
            return None
        return self.model.compute_logits(inputs.sampled_rows(hidden))

    def logits_rows(self, inputs: StepInputs) -> list[int]:
        """The rows of each ``compute_logits`` call ``logits`` and ``prompt_logprobs`` make for
        ``inputs``, in order (a pipeline's driver receives them as messages of these sizes)."""
        prompt = len(inputs.prompt_rows)
        chunks = [min(self.PROMPT_LOGITS_ROWS, prompt - i) for i in range(0, prompt, self.PROMPT_LOGITS_ROWS)]
        return ([len(inputs.sampled_ids)] if inputs.sampled_ids else []) + chunks

    def sample(self, logits: torch.Tensor, inputs: StepInputs, states: dict[str, RunnerRequestState],
               drafts_of: dict[str, list[int]]) -> tuple[dict[str, list[SampledToken]], dict[str, str]]:
        """Mask, sample, accept drafts. Returns each sampled request's kept tokens, and request
        id -> error for those whose tokens broke their grammar."""
        batch = self._batch(inputs, states, drafts_of)
        constrained = [(row, rid, params, batch.output_token_ids[row])
                       for row, (rid, params) in enumerate(zip(inputs.sampled_ids, batch.params))
                       if params.structured is not None]
        if constrained:
            if self.grammar is None:
                raise RuntimeError("a constrained request reached a runner without a grammar compiler")
            self.grammar.apply(logits, constrained)
        result = sample(logits, batch, argmax=self.ops.argmax, race=self.ops.exponential_race)
        kept = accept_drafts(inputs.sampled_ids, drafts_of, result)
        failed = {}
        if constrained:
            failed = self.grammar.advance([(rid, [t.token_id for t in kept[rid]])
                                           for rid in dict.fromkeys(rid for _, rid, _, _ in constrained)])
        return kept, failed

    def _batch(self, inputs: StepInputs, states: dict[str, RunnerRequestState],
               drafts_of: dict[str, list[int]]) -> SamplingBatch:
        rows = [states[rid] for rid in inputs.sampled_ids]
        # Row j of a request with drafts (its rows are consecutive) samples the token after
        # its first j drafts.
        drafted, j = [], 0
        for row, rid in enumerate(inputs.sampled_ids):
            j = j + 1 if row and inputs.sampled_ids[row - 1] == rid else 0
            drafted.append(drafts_of.get(rid, [])[:j])
        return SamplingBatch(
            params=[s.sampling_params for s in rows],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] if s.sampling_params.uses_penalties else []
                              for s in rows],
            output_token_ids=[s.token_ids[s.num_prompt_tokens:] + d for s, d in zip(rows, drafted)],
            eos_token_ids=self.eos_token_ids,
        )

    def prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, PromptLogprobs]:
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


def accept_drafts(sampled_ids: list[str], drafts_of: dict[str, list[int]],
                  result: SamplerOutput) -> dict[str, list[SampledToken]]:
    """Per request, its drafts up to the first its own sample disagrees with, then that
    sample (after the last draft: one more). Row j of a request samples after its first j drafts."""
    kept: dict[str, list[SampledToken]] = {}
    row = 0
    while row < len(sampled_ids):
        rid = sampled_ids[row]
        drafts = drafts_of.get(rid, [])
        toks = []
        for j in range(len(drafts) + 1):
            toks.append(_sampled_token(result, row + j))
            if j == len(drafts) or toks[-1].token_id != drafts[j]:
                break
        kept[rid] = toks
        row += len(drafts) + 1
    return kept


def _sampled_token(result: SamplerOutput, row: int) -> SampledToken:
    return SampledToken(
        result.token_ids[row],
        result.logprobs[row] if result.logprobs is not None else None,
        result.top_logprobs[row] if result.top_logprobs is not None else None,
    )
