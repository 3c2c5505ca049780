"""Offline API: ``LLM(model).generate(prompts, params)``, ``LLM(model).chat(messages, params)``,
``LLM(model).embed(prompts)`` and ``LLM(model).score(query, documents)``."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from travelator.chat import ChatMessageError, render_chat
from travelator.engine.engine import LLMEngine
from travelator.engine.outputs import RequestOutput, TokenLogprob
from travelator.engine_args import engine_config
from travelator.model.tokenizer import Tokenizer
from travelator.pooling_params import PoolingParams
from travelator.prompts import Prompt, PromptInput, parse_prompts
from travelator.sampling_params import SamplingParams
from travelator.scoring import ScoreFormat, relevance


@dataclass(slots=True)
class RequestTimings:
    """Seconds since the request arrived."""

    queued: float  # until first scheduled
    first_token: float  # time to first token
    total: float  # end-to-end


@dataclass(slots=True)
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprob] | None
    timings: RequestTimings | None


@dataclass(slots=True)
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]  # n of them
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With SamplingParams.pooling: the embedding, or the label tokens' logprobs.
    pooled: list[float] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


class LLM:
    """Offline generation over an ``LLMEngine``.

    ``kwargs`` are engine settings, by name: every field of the config sections in config.py
    (``dtype``, ``max_model_len``, ``num_kv_blocks``, ``max_num_seqs``, ``batching``,
    ``scheduling_policy``, ``max_overtakes``, ``tensor_parallel_size``, ...; ``travelator
    generate --help`` lists them with their defaults). An unknown one is a TypeError that
    lists the valid ones.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config(model, **kwargs))
        print(f"travelator: {self.engine.summary}", file=sys.stderr, flush=True)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (encode, decode, ``apply_chat_template``, special ids)."""
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[GenerationResult]:
        """Generate for every prompt; results come back in prompt order.

        A prompt is a string, a list of token ids, ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}``; a dict may carry a ``"cache_salt"`` (see prompts.py).
        All prompts are queued before any step runs, and one bad prompt fails the call
        without leaving the others half-run in the engine.
        """
        parsed = parse_prompts(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(parsed)
        params = list(params)
        if len(params) != len(parsed):
            raise ValueError("give one SamplingParams, or one per prompt")
        for p in params:
            p.validate()
        ids = self._queue(parsed, params)
        results = [
            GenerationResult(parsed[i].text, self.engine.scheduler.requests[rid].prompt_token_ids,
                             [None] * params[i].n)  # type: ignore[list-item]
            for rid, (i, j) in ids.items() if j == 0
        ]
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in ids}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        remaining = set(ids)
        while remaining:
            self.engine.wait_for_admission()  # dynamic batching: nobody else comes to fill it
            for out in self.engine.step():
                if out.request_id not in ids:
                    continue
                logprobs[out.request_id].extend(out.new_logprobs)
                if out.finished:
                    i, j = ids[out.request_id]
                    results[i].outputs[j] = _completion(j, out, logprobs[out.request_id], params[i])
                    if j == 0:
                        results[i].prompt_logprobs = out.prompt_logprobs
                        results[i].pooled = out.pooled
                    remaining.discard(out.request_id)
                    bar.update(1)
        bar.close()
        return results

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[GenerationResult]:
        """Generate the next turn of one conversation, or of each of a list of them, as vLLM's
        ``LLM.chat``: results in conversation order, each with the rendered prompt as its
        ``prompt``.

        A conversation is a list of ``{"role", "content"}`` messages (content a string or a
        list of ``{"type": "text", "text"}`` parts; assistant turns may carry ``tool_calls``).
        Each is rendered with the model's chat template (``chat_template``, a jinja source,
        replaces it; models without one use the tokenizer's fallback) exactly as the server's
        ``/v1/chat/completions`` renders it, ``tools`` offered to templates that show them and
        ``chat_template_kwargs`` as more template variables, then encoded without adding
        special tokens (the template wrote them). ``add_generation_prompt`` opens the
        assistant's turn; ``continue_final_message`` (with ``add_generation_prompt=False``)
        leaves the last message open for the model to continue. ValueError for a malformed
        message, naming it.
        """
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
            raise ChatMessageError("messages is a conversation (a list of message dicts) or a "
                                   "list of conversations")
        one = isinstance(messages[0], Mapping)
        conversations = [messages] if one else list(messages)
        texts, prompts = [], []
        for c, conversation in enumerate(conversations):
            try:
                text = render_chat(
                    self.tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tools=tools,
                    chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
            except ChatMessageError as exc:
                if one:
                    raise
                raise ChatMessageError(f"conversation {c}: {exc}", f"{c}.{exc.param}") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise ValueError(f"conversation {c} renders to an empty prompt")
            texts.append(text)
            prompts.append({"prompt_token_ids": ids})
        results = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for result, text in zip(results, texts):
            result.prompt = text
        return results

    def embed(self, prompts: PromptInput | Sequence[PromptInput], *, pooling: str = "last",
              normalize: bool = True, dimensions: int | None = None, use_tqdm: bool = True) -> list[list[float]]:
        """One embedding per prompt (prompts as ``generate`` takes them): the final hidden states
        (after the last norm) of the last prompt token, or their mean over every prompt token,
        scaled to unit length unless ``normalize`` is False. Each prompt runs as a prompt-only
        request in the same batches as any generation."""
        params = SamplingParams(max_tokens=0, pooling=PoolingParams(
            "embed", pooling, normalize, dimensions))
        return [r.pooled for r in self.generate(prompts, params, use_tqdm=use_tqdm)]

    def score(self, query: str, documents: Sequence[str], *, score_format: ScoreFormat | None = None,
              use_tqdm: bool = True) -> list[float]:
        """Each document's relevance to ``query`` in [0, 1]: the probability of the first label
        ("yes") against the others after a prompt that asks whether the document answers the
        query (``scoring.py``; ``score_format`` sets the prompt and the labels)."""
        fmt = score_format or ScoreFormat()
        params = SamplingParams(max_tokens=0, pooling=PoolingParams(
            "score", label_token_ids=fmt.label_token_ids(self.tokenizer)))
        prompts = [{"prompt_token_ids": fmt.prompt_token_ids(self.tokenizer, query, d)} for d in documents]
        return [relevance(r.pooled) for r in self.generate(prompts, params, use_tqdm=use_tqdm)]

    def _queue(self, prompts: list[Prompt], params: list[SamplingParams]) -> dict[str, tuple[int, int]]:
        """Add choice j of prompt i for every (i, j); request id -> (i, j). All or none."""
        ids: dict[str, tuple[int, int]] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                for j in range(p.n):
                    req = self.engine.add_request(prompt.engine_input, p if p.n == 1 else p.for_choice(j),
                                                  cache_salt=prompt.cache_salt)
                    ids[req.request_id] = (i, j)
        except ValueError:
            self.engine.abort_request(list(ids))
            raise
        return ids


def _completion(index: int, out: RequestOutput, logprobs: list[TokenLogprob],
                params: SamplingParams) -> Completion:
    t = out.times
    timings = None
    if t is not None and t.finished is not None:
        timings = RequestTimings(
            queued=(t.first_scheduled or t.finished) - t.arrival,
            first_token=(t.first_token or t.finished) - t.arrival,
            total=t.finished - t.arrival,
        )
    return Completion(
        index, out.text, out.output_token_ids, out.finish_reason, out.stop_reason,
        logprobs if params.logprobs is not None else None, timings,
    )
