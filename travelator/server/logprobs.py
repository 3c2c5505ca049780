"""Logprobs in the two OpenAI formats, with each token's text decoded in context."""

from __future__ import annotations

from travelator.engine.outputs import TokenLogprob
from travelator.server.protocol import (
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)


class TokenTexts:
    """The text each token adds, decoded in context (a short window of the ids before it)."""

    _WINDOW = 6

    def __init__(self, tokenizer, context: list[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context[-self._WINDOW:])

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _piece(self, window: list[int], prev: str, token_id: int) -> str:
        cur = self._decode(window + [token_id])
        if cur.startswith(prev):
            return cur[len(prev):]
        return self._decode([token_id])

    def push(self, token_id: int, alternatives=()) -> tuple[str, list[tuple[str, float]]]:
        window = self._ids[-self._WINDOW:]
        prev = self._decode(window)
        text = self._piece(window, prev, token_id)
        alts = [(self._piece(window, prev, t), lp) for t, lp in alternatives]
        self._ids = window + [token_id]
        return text, alts


def _top(lp: TokenLogprob) -> list[tuple[int, float]]:
    return sorted(lp.top_logprobs.items(), key=lambda kv: -kv[1])


class CompletionLogprobsBuilder:
    """Builds the legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def prompt(self, token_ids: list[int], prompt_logprobs: list[TokenLogprob | None] | None = None,
               top_n: int | None = None) -> CompletionLogprobs:
        """The echoed prompt: each token with its logprob and top alternatives from the
        engine's prompt logprobs; the first token (nothing predicts it) carries null, as in
        OpenAI's legacy API."""
        res = CompletionLogprobs()
        for k, tid in enumerate(token_ids):
            lp = prompt_logprobs[k] if prompt_logprobs is not None else None
            if lp is None:
                text, _ = self.texts.push(tid)
                res.top_logprobs.append(None)
            else:
                text, alts = self.texts.push(tid, _top(lp)[:top_n])
                tops = dict(alts)
                tops.setdefault(text, lp.logprob)
                res.top_logprobs.append(tops)
            res.tokens.append(text)
            res.token_logprobs.append(lp.logprob if lp is not None else None)
            res.text_offset.append(self.offset)
            self.offset += len(text)
        return res

    def add(self, logprobs: list[TokenLogprob], into: CompletionLogprobs | None = None) -> CompletionLogprobs:
        res = into or CompletionLogprobs()
        for lp in logprobs:
            top = _top(lp)
            text, alts = self.texts.push(lp.token_id, top)
            tops = dict(alts)
            tops.setdefault(text, lp.logprob)
            res.tokens.append(text)
            res.token_logprobs.append(lp.logprob)
            res.top_logprobs.append(tops)
            res.text_offset.append(self.offset)
            self.offset += len(text)
        return res


def chat_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob], top_n: int) -> list[ChatTokenLogprob]:
    res = []
    for lp in logprobs:
        text, alts = texts.push(lp.token_id, _top(lp)[:top_n])
        res.append(ChatTokenLogprob(
            token=text, logprob=lp.logprob, bytes=list(text.encode("utf-8")),
            top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode("utf-8"))) for t, v in alts],
        ))
    return res


def vllm_prompt_logprobs(tokenizer, token_ids: list[int], entries: list[TokenLogprob | None],
                         top_n: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else a dict by token
    id of the token itself (with its rank) and its ``top_n`` alternatives (ranks 1..)."""
    texts = TokenTexts(tokenizer, [], skip_special_tokens=False)
    result: list[dict[str, PromptLogprob] | None] = []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            texts.push(tid)
            result.append(None)
            continue
        alts = _top(entry)[:top_n]
        text, alt_texts = texts.push(tid, alts)
        item = {str(tid): PromptLogprob(logprob=entry.logprob, rank=entry.rank, decoded_token=text)}
        for rank, ((alt_id, alt_lp), (alt_text, _)) in enumerate(zip(alts, alt_texts), start=1):
            item.setdefault(str(alt_id), PromptLogprob(logprob=alt_lp, rank=rank, decoded_token=alt_text))
        result.append(item)
    return result
