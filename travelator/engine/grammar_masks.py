"""The model runner's side of structured outputs: one llguidance matcher per constrained
request, a token mask per constrained row before sampling, and the matcher advanced with the
sampled token. Unconstrained rows are not touched.

A matcher is built the first time its request samples, from the request's grammar and the
output tokens it already has, so a request readmitted after a preemption (whose runner state
was rebuilt) resumes its grammar where it was.
"""

from __future__ import annotations

import llguidance
import llguidance.torch
import torch

from travelator.model.ops import TorchOps
from travelator.model.tokenizer import Tokenizer
from travelator.sampling_params import SamplingParams


class GrammarMasks:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, ops: TorchOps) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ops = ops
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    def _llt(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:  # a few ms; only once a constrained request comes
            self._lltokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                eos_token=sorted(self._tokenizer.eos_token_ids))
        return self._lltokenizer

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    @torch.inference_mode()  # the logits are inference tensors
    def apply(self, logits: torch.Tensor, rows: list[tuple[int, str, SamplingParams, list[int]]]) -> None:
        """Mask ``logits`` in place: for each (row, request id, params, its output tokens so
        far) of a constrained request, every token its grammar does not allow next is -inf."""
        if not rows:
            return
        masks = llguidance.torch.allocate_token_bitmask(len(rows), self._vocab_size)
        for k, (_, rid, params, outputs) in enumerate(rows):
            matcher = self._matchers.get(rid)
            if matcher is None:
                matcher = llguidance.LLMatcher(self._llt(), params.structured.grammar_text)
                if outputs and not matcher.consume_tokens(outputs):
                    raise RuntimeError(f"request {rid}: its output no longer matches its grammar: "
                                       f"{matcher.get_error()}")
                self._matchers[rid] = matcher
            llguidance.torch.fill_next_token_bitmask(matcher, masks, k)
        index = torch.tensor([row for row, *_ in rows], dtype=torch.long, device=logits.device)
        self._ops.apply_token_bitmask(logits, masks.to(logits.device), index)

    def advance(self, request_id: str, token_id: int) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is not None and not matcher.consume_token(token_id):
            raise RuntimeError(f"request {request_id}: token {token_id} broke its grammar: {matcher.get_error()}")
