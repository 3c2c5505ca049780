"""``POST /v1/completions``: prompts (text or token ids, one or a batch) to choices."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from travelator.engine.outputs import RequestOutput
from travelator.server.constraints import constraint_spec
from travelator.server.errors import APIError
from travelator.server.generation import Generation
from travelator.server.logprobs import CompletionLogprobsBuilder, TokenTexts, vllm_prompt_logprobs
from travelator.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
    now,
)
from travelator.server.serving import EnginePrompt, OpenAIServing, usage
from travelator.server.streaming import event_stream, json_response, sse
from travelator.structured import StructuredOutput


@dataclass(slots=True)
class CompletionRun:
    """One completions request under way: what its answer needs besides the engine's outputs."""

    gen: Generation
    model: str
    created: int
    prompts: list[EnginePrompt]
    n: int
    echo_texts: list[str] | None  # per prompt, with echo
    logprobs: list[CompletionLogprobsBuilder] | None  # per choice, when logprobs were asked for
    include_usage: bool
    top_logprobs: int | None  # the request's logprobs (alternatives per echoed token)
    prompt_logprobs: int | None  # vLLM's prompt_logprobs field, when asked for
    tokenizer: object

    def vllm_prompt_logprobs(self, choice: int, out: RequestOutput):
        if self.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.tokenizer, self.prompt_of(choice).token_ids, out.prompt_logprobs,
                                    self.prompt_logprobs)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice: int) -> EnginePrompt:
        return self.prompts[choice // self.n]

    def echo_of(self, choice: int) -> str:
        return self.echo_texts[choice // self.n] if self.echo_texts is not None else ""

    def response(self, choices: list[CompletionChoice], totals: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.gen.id, created=self.created, model=self.model,
                                  choices=choices, usage=totals)


def _prompts(serving: OpenAIServing, prompt) -> list[EnginePrompt]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise APIError(400, "the prompt is empty", param="prompt")
            prompts.append(EnginePrompt(p, serving.tokenizer.encode(p)))
        else:
            prompts.append(EnginePrompt(None, list(p)))
    return prompts


def _prepare(serving: OpenAIServing, req: CompletionRequest, structured: StructuredOutput | None) -> CompletionRun:
    """Everything before the engine: tokenised, validated, not yet queued (a preprocessing worker)."""
    model = serving.resolve_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    prompts = _prompts(serving, req.prompt)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # the OpenAI default
    # echo + logprobs scores the prompt (what evaluation harnesses send, max_tokens 0 or 1);
    # so does vLLM's prompt_logprobs field. The engine computes the larger of the two.
    wanted = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs) if n is not None]
    params = serving.sampling_params(req, max_tokens, req.logprobs,
                                     prompt_logprobs=max(wanted) if wanted else None, structured=structured)
    gen = serving.prepare(prompts, params, req, "prompt", "cmpl")
    echo_texts = None
    if req.echo:
        echo_texts = [p.text if p.text is not None else serving.tokenizer.decode(p.token_ids)
                      for p in prompts]
    builders = None
    if req.logprobs is not None:
        builders = [CompletionLogprobsBuilder(TokenTexts(
            serving.tokenizer, [] if req.echo else prompts[i // params.n].token_ids,
            params.skip_special_tokens)) for i in range(len(prompts) * params.n)]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return CompletionRun(gen, model, now(), prompts, params.n, echo_texts, builders, include_usage,
                         req.logprobs, req.prompt_logprobs, serving.tokenizer)


async def create_completion(serving: OpenAIServing, req: CompletionRequest, request: Request) -> Response:
    serving.resolve_model(req.model)  # a 404 before any compile
    structured = await serving.constraints.compile(constraint_spec(req))
    run = await serving.preprocessor.run(_prepare, serving, req, structured)
    serving.launch(run.gen)
    if req.stream:
        return event_stream(run.gen, _stream(run))
    builders = run.logprobs
    lps: list[CompletionLogprobs | None] = [None] * run.num_choices

    def on_output(i: int, out: RequestOutput) -> None:
        if builders is None:
            return
        if lps[i] is None:  # the first output: the prompt is computed, its logprobs known
            lps[i] = (builders[i].prompt(run.prompt_of(i).token_ids, out.prompt_logprobs, run.top_logprobs)
                      if req.echo else CompletionLogprobs())
        builders[i].add(out.new_logprobs, into=lps[i])

    finals = await serving.collect(request, run.gen, run.num_choices, on_output)
    if finals is None:  # the client left; nobody reads this
        return Response(status_code=499)
    choices = [
        CompletionChoice(index=i, text=run.echo_of(i) + out.text,
                         logprobs=lps[i] if builders is not None else None,
                         finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                         prompt_logprobs=run.vllm_prompt_logprobs(i, out))
        for i, out in enumerate(finals)
    ]
    return json_response(run.response(choices, usage(run.prompts, finals, run.n)))


async def _stream(run: CompletionRun) -> AsyncIterator[str]:
    def chunk(i: int, text: str, lp: CompletionLogprobs | None = None,
              out: RequestOutput | None = None, prompt_logprobs=None) -> str:
        done = out is not None and out.finished
        return sse(run.response([CompletionChoice(
            index=i, text=text, logprobs=lp, finish_reason=out.finish_reason if done else None,
            stop_reason=out.stop_reason if done else None, prompt_logprobs=prompt_logprobs)]))

    builders = run.logprobs
    # With logprobs the echo waits for the choice's first output, which brings the prompt's.
    echo_first = run.echo_texts is not None and builders is None
    if echo_first:
        for i in range(run.num_choices):
            yield chunk(i, run.echo_of(i))
    echoed = [echo_first or run.echo_texts is None] * run.num_choices
    first = [True] * run.num_choices
    finals: list[RequestOutput | None] = [None] * run.num_choices
    async for i, out in run.gen.outputs():
        if not echoed[i]:
            echoed[i] = True
            yield chunk(i, run.echo_of(i),
                        builders[i].prompt(run.prompt_of(i).token_ids, out.prompt_logprobs, run.top_logprobs))
        if first[i]:  # the prompt's logprobs in vLLM's shape ride on the choice's first chunk
            first[i] = False
            if (plp := run.vllm_prompt_logprobs(i, out)) is not None:
                yield chunk(i, "", prompt_logprobs=plp)
        lp = builders[i].add(out.new_logprobs) if builders else None
        if out.finished:
            finals[i] = out
        elif not out.new_token_ids and not out.new_text and not (lp and lp.tokens):
            continue  # one chunk per token step, with "" while the detokenizer holds text back
        yield chunk(i, out.new_text, lp, out)
    if run.include_usage:
        yield sse(run.response([], usage(run.prompts, finals, run.n)))
