"""Output constraints of HTTP requests: read from the fields a client set (vLLM's
``structured_outputs``, OpenAI's ``response_format``, a forced tool call), then compiled on a
worker thread, never on the event loop or the engine's step thread.

A request whose constraint is compiling waits for it alone; other requests go on. A constraint
larger than the server's size bound, that does not compile, or that takes longer than the
server's time limit, is a 400 naming the field. The time limit ends the wait, not the compile
(a thread cannot be stopped); the size bound, checked before any work, is what keeps a compile
from holding its thread for long.
Compiled constraints are kept (least recently used out first), keyed by what the client sent,
so a schema sent again costs nothing; the engine's GrammarCompiler keeps the compiled matcher.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.errors import InvalidRequestError
from travelator.json_grammar import NumberLimits
from travelator.server.errors import APIError
from travelator.server.protocol import SamplingFields, StructuredOutputs
from travelator.strict_schema import close_objects
from travelator.structured import StructuredOutput


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """What a client asked for: StructuredOutput's fields, and the request field it came from."""
    fields: dict[str, Any]
    param: str

    @property
    def key(self) -> str:
        # Key order kept: a schema's property order is the order of the output.
        return json.dumps(self.fields)


def structured_outputs_spec(fields: StructuredOutputs | None) -> ConstraintSpec | None:
    """vLLM's ``structured_outputs``."""
    if fields is None:
        return None
    schema = fields.json_
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise APIError(400, f"structured_outputs.json is not JSON: {exc}", param="structured_outputs.json") from None
    given = {"json": schema, "json_object": bool(fields.json_object) or None, "regex": fields.regex,
             "choice": fields.choice, "grammar": fields.grammar}
    return ConstraintSpec({k: v for k, v in given.items() if v is not None}, "structured_outputs")


def response_format_spec(fmt: dict | None) -> ConstraintSpec | None:
    """OpenAI's ``response_format``: text (no constraint), json_object, or json_schema (its
    ``schema``, strict or not: the output always matches it here; a strict one is closed)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec({"json_object": True}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "response_format.json_schema must be an object with a 'schema' object",
                           param="response_format.json_schema")
        schema = spec.get("schema", {})
        return ConstraintSpec({"json": close_objects(schema) if spec.get("strict") is True else schema},
                              "response_format")
    raise APIError(400, f"response_format {kind!r} is not supported (text, json_object, json_schema)",
                   param="response_format")


def constraint_spec(req: SamplingFields, forced_tool_call: dict[str, Any] | None = None) -> ConstraintSpec | None:
    """A request's one constraint: a forced tool call's schema, ``response_format`` (chat and
    completions), or ``structured_outputs``; a 400 when it sets more than one."""
    return single_constraint(
        ConstraintSpec({"json": forced_tool_call}, "tools") if forced_tool_call is not None else None,
        response_format_spec(getattr(req, "response_format", None)),
        structured_outputs_spec(req.structured_outputs))


def single_constraint(*specs: ConstraintSpec | None) -> ConstraintSpec | None:
    """The one constraint among ``specs`` that is set, or a 400 naming the second one set."""
    given = [spec for spec in specs if spec is not None]
    if len(given) > 1:
        raise APIError(400, f"{given[0].param} and {given[1].param} both constrain the output; give one",
                       param=given[1].param)
    return given[0] if given else None


class ConstraintCompiler:
    """Compiles constraints on its own two threads: a slow compile holds up neither the event
    loop, nor the engine, nor (beyond those threads) other requests' compiles. Requests that
    send a constraint already compiling wait for that one compile."""

    def __init__(self, grammars: GrammarCompiler, timeout_s: float, max_bytes: int,
                 number_limits: NumberLimits = NumberLimits(), cache_size: int = 256) -> None:
        self._grammars = grammars
        self._number_limits = number_limits
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._cache_size = cache_size
        self._compiled: OrderedDict[str, StructuredOutput] = OrderedDict()
        self._compiling: dict[str, asyncio.Future[StructuredOutput]] = {}
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")

    async def compile(self, spec: ConstraintSpec | None) -> StructuredOutput | None:
        if spec is None:
            return None
        key = spec.key
        size = len(key.encode())
        if size > self._max_bytes:
            raise APIError(400, f"the {spec.param} constraint is {size} bytes; this server compiles constraints "
                                f"of up to {self._max_bytes} (--max-constraint-bytes)", param=spec.param)
        structured = self._compiled.get(key)
        if structured is not None:
            self._compiled.move_to_end(key)
            return structured
        compiling = self._compiling.get(key)
        if compiling is None:
            compiling = asyncio.get_running_loop().run_in_executor(self._threads, self._build, spec)
            self._compiling[key] = compiling
            compiling.add_done_callback(lambda done, key=key: self._keep(key, done))
        try:
            # shield: a request that gives up does not cancel the compile others wait for.
            return await asyncio.wait_for(asyncio.shield(compiling), self._timeout_s)
        except asyncio.TimeoutError:
            raise APIError(400, f"the {spec.param} constraint took more than {self._timeout_s:g} s to "
                                f"compile", param=spec.param) from None
        except InvalidRequestError as exc:
            # StructuredOutput names its own field (structured_outputs.regex, ...); name the
            # field the client used when it was another.
            param = exc.param if spec.param == "structured_outputs" and exc.param else spec.param
            raise APIError(400, str(exc), param=param) from None

    def _keep(self, key: str, done: asyncio.Future[StructuredOutput]) -> None:
        del self._compiling[key]
        if done.cancelled() or done.exception() is not None:
            return
        self._compiled[key] = done.result()
        while len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)

    def _build(self, spec: ConstraintSpec) -> StructuredOutput:
        fields = dict(spec.fields)
        if "choice" in fields:
            fields["choice"] = tuple(fields["choice"])
        structured = StructuredOutput(**fields, number_digits=self._number_limits.digits,
                                      exponent_digits=self._number_limits.exponent_digits)
        self._grammars.compile(structured)
        return structured
