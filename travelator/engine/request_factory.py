"""Turn a prompt and its sampling parameters into a validated ``Request``.

Validation needs only the tokenizer, the vocabulary, the context limit and the grammar
compiler, not the model: the engine uses it before queueing, and the front end of a
disaggregated server (which holds no model) uses it before sending a request to a worker.
"""

from __future__ import annotations

import itertools

from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.engine.request import Request, RequestSpec
from travelator.errors import ContextLengthError, InvalidRequestError
from travelator.model.tokenizer import Tokenizer
from travelator.sampling_params import SamplingParams


class RequestFactory:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: frozenset[int], grammars: GrammarCompiler) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self._ids = itertools.count()

    def make_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def make_request(self, spec: RequestSpec) -> Request:
        """Validate and tokenise; changes no engine state, so any thread may call it.

        Raises InvalidRequestError (a ValueError) naming the field at fault on bad input.
        """
        params = spec.params
        params.validate()
        token_ids = self._prompt_token_ids(spec.prompt)
        vocab = self.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        max_tokens = self._max_tokens(len(token_ids), params)
        if params.structured is not None:
            # Compiled here, on the caller's thread, so the step finds it ready (a lookup
            # when the server compiled it already).
            self.grammars.compile(params.structured)
        return Request(
            request_id=spec.request_id or self.make_request_id(),
            prompt_token_ids=token_ids,
            sampling_params=params,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            priority=spec.priority,
            cache_salt=spec.cache_salt,
        )

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", "prompt")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        return token_ids

    def _max_tokens(self, n: int, params: SamplingParams) -> int:
        """The output's length limit: the one asked for, or all the room the context leaves."""
        if n >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {n} tokens, but the context is {self.max_model_len} tokens "
                f"and at least one must be left for the output", "prompt")
        room = self.max_model_len - n
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ContextLengthError(
                f"the prompt has {n} tokens and max_tokens is {max_tokens}, together "
                f"{n + max_tokens}, more than the context of {self.max_model_len} tokens",
                "max_tokens")
        return max_tokens
