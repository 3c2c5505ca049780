"""The model runner's side of structured outputs: one llguidance matcher per constrained
request, a token mask per constrained row before sampling, and the matcher advanced with the
sampled token. Unconstrained rows are not touched.

A matcher is made the first time its request samples (a copy of its grammar's compiled
template, see GrammarCompiler), advanced over the output tokens the request already has, so a
request readmitted after a preemption (whose runner state was rebuilt) resumes its grammar
where it was.

Filling a mask is the grammar's cost (tens of microseconds a row with a 32k vocabulary), so
it is kept off the step's critical path: once a step has sampled and advanced the matchers
(cheap), one background thread fills their next masks while the next step's forward pass
runs; llguidance releases the GIL for that work. The next step waits for it only where it is
not done, and fills on the spot the masks of requests that were not in the previous step (new,
or readmitted).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np
import torch

from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.model.ops import TorchOps
from travelator.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class _NextMasks:
    """Masks filled ahead, one row per request id, for the matchers' current states."""
    masks: np.ndarray  # [rows, words] int32, no more rows than matchers
    row_of: dict[str, int]
    matchers: dict[str, llguidance.LLMatcher]  # the matcher each row was filled from, in row order


class GrammarMasks:
    def __init__(self, compiler: GrammarCompiler, ops: TorchOps) -> None:
        self._compiler = compiler
        self._vocab_size = compiler.vocab_size
        self._ops = ops
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # One llguidance thread: the forward pass already uses every core.
        self._llexecutor = llguidance.LLExecutor(num_threads=1)
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        self._pending: Future[_NextMasks] | None = None

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def shutdown(self) -> None:
        self._background.shutdown(wait=True, cancel_futures=True)

    def _collect_pending(self) -> _NextMasks | None:
        """Wait for the masks filled in the background; raise what went wrong there."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    @torch.inference_mode()  # the logits are inference tensors
    def apply(self, logits: torch.Tensor, rows: list[tuple[int, str, SamplingParams, list[int]]]) -> None:
        """Mask ``logits`` in place: for each (row, request id, params, its output tokens so
        far) of a constrained request, every token its grammar does not allow next is -inf.
        A request with draft tokens (speculative decoding) has consecutive rows, the j-th
        after its first j drafts; their masks follow the grammar through the drafts."""
        ahead = self._collect_pending()
        sources: list[int] = []  # per row, its row in ahead.masks (-1: fill it now)
        to_fill, with_drafts = [], []
        k = 0
        while k < len(rows):
            _, rid, params, outputs = rows[k]
            span = 1
            while k + span < len(rows) and rows[k + span][1] == rid:
                span += 1
            matcher = self._matchers.get(rid)
            if span == 1 and ahead is not None and matcher is not None and ahead.matchers.get(rid) is matcher:
                sources.append(ahead.row_of[rid])
                k += 1
                continue
            if matcher is None:
                matcher = self._compiler.new_matcher(params.structured)
                if outputs and not matcher.consume_tokens(outputs):
                    raise RuntimeError(f"request {rid}: its output no longer matches its grammar: "
                                       f"{matcher.get_error()}")
                self._matchers[rid] = matcher
            sources.extend([-1] * span)
            if span == 1:
                to_fill.append((matcher, k))
            else:  # masks after each draft; the matcher itself is left where it was
                with_drafts.append((matcher, k, rows[k + span - 1][3][len(outputs):]))
            k += span
        if ahead is not None and not to_fill and not with_drafts and sources == list(range(len(ahead.matchers))):
            masks = ahead.masks  # the usual step: the same rows in the same order
        else:
            masks = llguidance.numpy.allocate_token_bitmask(len(rows), self._vocab_size)
            kept = [(k, src) for k, src in enumerate(sources) if src >= 0]
            if kept:
                dst, src = zip(*kept)
                masks[list(dst)] = ahead.masks[list(src)]
            if to_fill:
                llguidance.numpy.fill_next_token_bitmask_par(self._llexecutor, to_fill, masks)
            if with_drafts:
                # Rows after a draft the grammar refuses stay all-allowed: the sample before
                # them cannot equal that draft, so they are never used.
                llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._llexecutor, with_drafts, masks)
        index = torch.tensor([row for row, *_ in rows], dtype=torch.long, device=logits.device)
        self._ops.apply_token_bitmask(logits, torch.from_numpy(masks).to(logits.device), index)

    def advance(self, sampled: list[tuple[str, list[int]]]) -> dict[str, str]:
        """Advance each (request id, tokens it kept this step)'s matcher (here: a refused
        token must fail its own request in this step), then fill the masks of their next
        step in the background; the next ``apply`` collects them. Returns request id ->
        error for the requests whose token their grammar refused (a bug: the mask allowed it)."""
        if not sampled:
            return {}
        self._collect_pending()  # one batch of background work at a time
        work = [(rid, self._matchers[rid], tokens) for rid, tokens in sampled]
        single = [(matcher, tokens[0]) for _, matcher, tokens in work if len(tokens) == 1]
        accepted = iter(self._llexecutor.consume_token_par(single) if single else [])
        failed = {}
        for rid, matcher, tokens in work:
            ok = next(accepted) if len(tokens) == 1 else _consume_until_stopped(matcher, tokens)
            if not ok:
                failed[rid] = f"tokens {tokens} broke its grammar: {matcher.get_error()}"
        for rid in failed:
            self.forget(rid)
        # A stopped matcher (its grammar complete and EOS taken) has no next mask.
        live = [(rid, matcher) for rid, matcher, _ in work if rid not in failed and not matcher.is_stopped()]
        if live:
            self._pending = self._background.submit(self._fill, live)
        return failed

    def _fill(self, live: list[tuple[str, llguidance.LLMatcher]]) -> _NextMasks:
        masks = llguidance.numpy.allocate_token_bitmask(len(live), self._vocab_size)
        llguidance.numpy.fill_next_token_bitmask_par(
            self._llexecutor, [(matcher, k) for k, (_, matcher) in enumerate(live)], masks)
        return _NextMasks(masks, {rid: k for k, (rid, _) in enumerate(live)}, dict(live))


def _consume_until_stopped(matcher: llguidance.LLMatcher, tokens: list[int]) -> bool:
    """Consume a request's tokens up to its grammar's end: accepted drafts may go on past the
    EOS that completes it, and the request ends at that EOS (the output processor cuts it)."""
    for token in tokens:
        if matcher.is_stopped():
            return True
        if not matcher.consume_token(token):
            return False
    return True
