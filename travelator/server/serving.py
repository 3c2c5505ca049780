"""What the OpenAI endpoints share: the model name, admission, sampling parameters, prompt
checks, starting a generation, usage, collecting a non-streamed answer, and shutdown.

The endpoints themselves are in completions.py, chat.py, responses.py and pooling.py. Each prepares its
request on a preprocessing worker (``preprocess.py``): the prompt rendered and tokenised, the
engine requests made by the ``EngineClient`` (``engine/client.py``), whose ``make_request``
validates without changing engine state. Back on the event loop, ``launch`` admits them and
``submit``s them all; ``snapshot`` reads the queues. A request's sub-requests are all validated
before any is queued, and the requests validated are the ones queued.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from travelator.engine.client import EngineClient, EngineDeadError, RequestSpec
from travelator.engine.outputs import RequestOutput
from travelator.engine.request import Request as EngineRequest
from travelator.errors import ContextLengthError, InvalidRequestError
from travelator.json_grammar import NumberLimits
from travelator.pooling_params import PoolingParams
from travelator.sampling_params import SamplingParams
from travelator.server.constraints import ConstraintCompiler
from travelator.server.errors import APIError
from travelator.server.generation import Generation
from travelator.server.harmony import HarmonyFormat, detect_harmony
from travelator.server.metrics import ServerMetrics
from travelator.server.preprocess import Preprocessor
from travelator.server.protocol import PromptTokensDetails, SamplingFields, Usage, random_id
from travelator.server.settings import ServerSettings
from travelator.server.streaming import unless_disconnected
from travelator.server.tools import ToolCallFormat, detect_tool_call_format
from travelator.structured import StructuredOutput

logger = logging.getLogger(__name__)

_OPTIONAL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                             "frequency_penalty", "repetition_penalty")


@dataclass(slots=True)
class EnginePrompt:
    text: str | None  # as the client gave it, when it was text
    token_ids: list[int]


def usage(prompts: list[EnginePrompt], finals: list[RequestOutput], n: int) -> Usage:
    """Each prompt counted once, every choice's output tokens, and the prompt tokens that came
    from the prefix cache (choice i * n is prompt i's first)."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(o.output_token_ids) for o in finals)
    cached = sum(finals[i * n].num_cached_tokens for i in range(len(prompts)))
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class OpenAIServing:
    def __init__(self, client: EngineClient, settings: ServerSettings, metrics: ServerMetrics,
                 served_model_names: list[str]) -> None:
        self.client = client
        self.model = client.served_model
        self.tokenizer = self.model.tokenizer
        self.settings = settings
        self.metrics = metrics
        self.served_model_names = served_model_names
        self.draining = False
        self.on_shutdown: list[Callable[[], None]] = []  # run (on the event loop) when draining begins
        self.loop: asyncio.AbstractEventLoop | None = None
        self.constraints = ConstraintCompiler(self.model.grammars, settings.grammar_compile_timeout_s,
                                              settings.max_constraint_bytes,
                                              NumberLimits(settings.json_number_digits, settings.json_exponent_digits))
        self.preprocessor = Preprocessor()
        self.tool_call_format: ToolCallFormat = (
            detect_tool_call_format(self.tokenizer.chat_template) if settings.tool_call_parser == "auto"
            else settings.tool_call_parser)
        # Hermes tags that are special tokens would vanish from decoded text: such requests
        # keep special tokens in their text, for the tool-call reader.
        tag = self.tokenizer.encode("<tool_call>", add_special_tokens=False)
        self.tool_tags_are_special = len(tag) == 1 and tag[0] in self.tokenizer.special_token_ids
        # gpt-oss: answers are read for their channels (server/harmony.py).
        self.harmony: HarmonyFormat | None = detect_harmony(self.tokenizer)

    # ---- checks ------------------------------------------------------------------------
    def resolve_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names:
            return name or self.served_model_names[0]
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.served_model_names)}",
                       param="model", code="model_not_found")

    def _admit(self) -> None:
        if self.draining:
            self.metrics.rejected("shutting_down")
            raise APIError(503, "the server is shutting down and accepts no new requests",
                           code="shutting_down")
        if not self.client.healthy:
            self.metrics.rejected("engine_dead")
            raise APIError(503, f"the engine has stopped: {self.client.error!r}", code="engine_dead")
        # In flight but not running = waiting (or just handed over and about to be scheduled).
        snapshot = self.client.snapshot()
        waiting = max(0, snapshot.num_in_flight - snapshot.num_running)
        limit = self.settings.max_waiting
        if limit is not None and waiting >= limit:
            self.metrics.rejected("queue_full")
            raise APIError(503, f"the server is overloaded: {waiting} requests are already waiting "
                                f"(limit {limit}); retry later, or start the server with a larger "
                                f"--max-waiting (or without it: no limit)",
                           code="queue_full", headers={"Retry-After": "1"})

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        n = 1 if req.n is None else req.n
        if n > self.settings.max_n:
            raise APIError(400, f"n is {n}, more than this server's limit of {self.settings.max_n}", param="n")
        kw: dict[str, Any] = {
            "n": n, "max_tokens": max_tokens, "seed": req.seed, "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "structured": structured,
            "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            "stop_token_ids": list(req.stop_token_ids or []), "ignore_eos": req.ignore_eos,
            "speculate": req.speculate,
            "min_tokens": req.min_tokens, "skip_special_tokens": req.skip_special_tokens,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "stop_limits": self.settings.stop_limits,
        }
        for name in _OPTIONAL_SAMPLING_FIELDS:
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        try:
            return SamplingParams(**kw)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    def _make_request(self, spec: RequestSpec, prompt_param: str) -> EngineRequest:
        """``prompt_param``: where the client put the prompt ("prompt", or "messages")."""
        try:
            return self.client.make_request(spec)
        except InvalidRequestError as exc:
            param = prompt_param if exc.param in (None, "prompt") else exc.param
            code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
            raise APIError(400, str(exc), param=param, code=code) from None

    # ---- one request ---------------------------------------------------------------------
    def prepare(self, prompts: list[EnginePrompt], params: SamplingParams, req: SamplingFields,
                prompt_param: str, id_prefix: str) -> Generation:
        """Validate every choice of every prompt (choice j of prompt i is sub-request
        i * n + j): a generation that ``launch`` starts. Any thread."""
        self._check_priority(req.priority)
        n = params.n
        if len(prompts) * n > self.settings.max_choices_per_request:
            raise APIError(400, f"{len(prompts)} prompts x n={n} is more than this server's limit of "
                                f"{self.settings.max_choices_per_request} choices per request", param="n")
        gen_id = random_id(id_prefix)
        try:  # a route may have changed the parameters since they were made (chat: its stop tokens)
            choices = [params.for_choice(j) for j in range(n)]
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        specs = [RequestSpec(p.token_ids, choices[j], f"{gen_id}-{i * n + j}", req.priority, req.cache_salt)
                 for i, p in enumerate(prompts) for j in range(n)]
        return Generation(self.client, gen_id, [self._make_request(spec, prompt_param) for spec in specs])

    def prepare_prompt_only(self, prompts: list[EnginePrompt], pooling: PoolingParams, priority: int,
                            prompt_param: str, id_prefix: str) -> Generation:
        """Validate a prompt-only request per prompt (an embedding or a score each, request i
        for prompt i): a generation that ``launch`` starts. Any thread."""
        self._check_priority(priority)
        params = SamplingParams(max_tokens=0, pooling=pooling)
        gen_id = random_id(id_prefix)
        specs = [RequestSpec(p.token_ids, params, f"{gen_id}-{i}", priority) for i, p in enumerate(prompts)]
        return Generation(self.client, gen_id, [self._make_request(spec, prompt_param) for spec in specs])

    def _check_priority(self, priority: int) -> None:
        low, high = self.settings.priority_range
        if not low <= priority <= high:
            # Not echoed: the JSON integer may have thousands of digits.
            raise APIError(400, f"priority must be an integer in [{low}, {high}]", param="priority")

    def launch(self, gen: Generation) -> None:
        """Admit ``gen`` and queue its requests (event loop)."""
        self._admit()
        try:
            gen.start()
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    async def collect(self, request: Request, gen: Generation, num_choices: int,
                      on_output: Callable[[int, RequestOutput], None]) -> list[RequestOutput] | None:
        """Every choice's final output, or None if the client went away first. Closes ``gen``."""
        async def run() -> list[RequestOutput | None]:
            finals: list[RequestOutput | None] = [None] * num_choices
            async for i, out in gen.outputs():
                on_output(i, out)
                if out.finished:
                    finals[i] = out
            return finals

        try:
            finished, finals = await unless_disconnected(request, run)
        except EngineDeadError as exc:
            raise APIError(500, str(exc), code="engine_dead") from None
        finally:
            gen.close()
        return finals if finished else None

    # ---- shutdown --------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Stop accepting; abort what is still in flight after the grace period (event loop thread)."""
        if self.draining:
            return
        self.draining = True
        self.client.stop_accepting()
        for hook in self.on_shutdown:
            hook()
        in_flight = self.client.num_in_flight
        grace = self.settings.shutdown_grace_s
        logger.warning("shutting down: %d requests in flight get %.1f s to finish", in_flight, grace)
        if in_flight:
            asyncio.get_running_loop().call_later(grace, self._abort_in_flight)

    def _abort_in_flight(self) -> None:
        if self.client.num_in_flight:
            logger.warning("grace period over: aborting %d requests", self.client.num_in_flight)
            self.client.abort_all()
