"""Grammars compiled for one model's tokenizer, once per grammar.

Building an llguidance matcher compiles its grammar against the vocabulary: under a
millisecond for a small JSON schema, up to a second for a huge grammar. The compiler keeps
the freshly built matcher of each recent grammar as a template; every request under that
grammar starts from a copy of it (microseconds). The server compiles a request's grammar on a
worker thread before the request reaches the engine, so a slow compile holds up only its own
request; the model runner then finds the template here.

Thread-safe: the server's workers and the engine's step thread both use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance

from travelator.errors import InvalidRequestError
from travelator.model.tokenizer import Tokenizer
from travelator.structured import StructuredOutput


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._cache_size = cache_size
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _llt(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:  # ~0.1 s for 32k tokens; only once a grammar comes
                self._lltokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=sorted(self._tokenizer.eos_token_ids))
            return self._lltokenizer

    def compile(self, structured: StructuredOutput) -> None:
        """Compile ``structured``'s grammar unless a template of it is kept; raise
        InvalidRequestError when it does not compile for this tokenizer."""
        self._template(structured)

    def new_matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A matcher at the start of ``structured``'s grammar."""
        return self._template(structured).deep_copy()

    def _template(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        key = structured.grammar_text
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template
        # Built outside the lock (llguidance drops the GIL meanwhile): a slow grammar does
        # not hold up others. Two threads may build the same one; either copy is right.
        template = llguidance.LLMatcher(self._llt(), key)
        if template.is_error():
            raise InvalidRequestError(f"the {structured.param.split('.')[-1]} constraint does not compile: "
                                      f"{template.get_error()}", structured.param)
        with self._lock:
            self._templates[key] = template
            self._templates.move_to_end(key)
            while len(self._templates) > self._cache_size:
                self._templates.popitem(last=False)
        return template
