"""The ``EngineClient`` seam: both engines implement it, a request is validated once (the
request validated is the one queued), and the snapshot reads what the engine holds.

The disaggregated front end starts worker processes, so it is checked here by its shape (every
member of the protocol, with the protocol's parameters); tests/disagg/test_disaggregation.py serves
through it."""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap

import pytest

from travelator import LLM, SamplingParams
from travelator.disagg.frontend import DisaggregatedFrontEnd
from travelator.engine.async_engine import AsyncEngine
from travelator.engine.client import (
    EngineClient,
    EngineCounters,
    EngineDeadError,
    EngineSnapshot,
    RequestSpec,
    ServedModel,
    stream_outputs,
)
from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.engine.request import Request
from travelator.errors import InvalidRequestError
from travelator.model.loader import open_model
from travelator.server.app import build_app
from travelator.server.settings import ServerSettings

PROMPT = [5, 6, 7, 8]


def _protocol_members() -> dict[str, object]:
    """Name -> what the protocol declares: a function, a property, or None (a data member)."""
    members: dict[str, object] = dict.fromkeys(EngineClient.__annotations__)
    members.update({n: v for n, v in vars(EngineClient).items()
                    if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))})
    return members


def _assigned_on_self(cls: type) -> set[str]:
    """Attributes the class's methods assign to ``self`` (``self.x = ...``, tuples included)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def _shape_problems(cls: type) -> list[str]:
    problems = []
    assigned = _assigned_on_self(cls)
    for name, declared in _protocol_members().items():
        have = inspect.getattr_static(cls, name, None)
        if inspect.isfunction(declared):
            if not inspect.isfunction(have):
                problems.append(f"{name}: not a method")
            elif list(inspect.signature(have).parameters) != list(inspect.signature(declared).parameters):
                problems.append(f"{name}: parameters {inspect.signature(have)}, "
                                f"the protocol's {inspect.signature(declared)}")
            elif inspect.iscoroutinefunction(have) != inspect.iscoroutinefunction(declared):
                problems.append(f"{name}: async where the protocol is not, or the other way")
        elif have is None and name not in assigned:
            problems.append(f"{name}: missing")
    return problems


@pytest.mark.parametrize("cls", [AsyncEngine, DisaggregatedFrontEnd], ids=lambda c: c.__name__)
def test_both_engines_have_the_protocols_shape(cls):
    assert _shape_problems(cls) == []


def test_the_shape_check_can_fail():
    class Partial:
        def __init__(self) -> None:
            self.step_listeners = []

        def submit(self, request, extra):
            pass

        async def abort(self, request_id):
            pass

    problems = _shape_problems(Partial)
    assert "step_listeners: missing" not in problems
    assert "death_listeners: missing" in problems
    assert any(p.startswith("submit: parameters") for p in problems)
    assert any(p.startswith("abort: async") for p in problems)


@pytest.fixture(scope="module")
def llm():
    return LLM("dummy:tiny", dtype="float32")


def test_the_single_engine_is_a_client(llm):
    assert isinstance(AsyncEngine(llm.engine), EngineClient)


def test_the_request_validated_is_the_one_queued(llm):
    client = AsyncEngine(llm.engine)
    queued = []
    enqueue = llm.engine.enqueue
    llm.engine.enqueue = lambda req: (queued.append(req), enqueue(req))

    async def scenario():
        client.start()
        try:
            spec = RequestSpec(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), "seam-1", 0, "salt")
            req = client.make_request(spec)
            assert client.snapshot().num_in_flight == 0  # making it changed nothing
            outs = [out async for out in _read(client.submit(req))]
            return req, outs
        finally:
            client.stop()

    try:
        req, outs = asyncio.run(scenario())
    finally:
        del llm.engine.enqueue
    assert queued == [req] and queued[0] is req
    assert req.cache_salt == "salt" and outs[-1].finished and len(outs[-1].output_token_ids) == 3


async def _read(stream: asyncio.Queue):
    while True:
        out = await stream.get()
        yield out
        if out.finished:
            return


def test_generate_takes_a_spec(llm):
    client = AsyncEngine(llm.engine)

    async def scenario():
        client.start()
        try:
            return [o async for o in client.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True)))]
        finally:
            client.stop()

    outs = asyncio.run(scenario())
    assert outs[-1].finished and len(outs[-1].output_token_ids) == 2


def test_the_snapshot_reads_the_engine(llm):
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(max_tokens=1, ignore_eos=True))
    snap = AsyncEngine(engine).snapshot()
    assert isinstance(snap, EngineSnapshot)
    assert (snap.num_running, snap.num_waiting, snap.num_in_flight) == (0, 1, 0)
    assert snap.kv_total_blocks == engine.kv.num_blocks
    assert snap.kv_used_blocks + snap.kv_free_blocks == engine.kv.num_blocks
    while engine.has_unfinished_requests():
        engine.step()
    after = AsyncEngine(engine).snapshot()
    assert after.counters.finished.get("length", 0) == snap.counters.finished.get("length", 0) + 1
    assert after.prefix_queried_tokens == engine.kv.stats.queried_tokens
    assert after.counters is not engine.counters  # a copy: the step thread goes on


def test_the_server_validates_each_choice_once(llm):
    """A request with two choices: two validations, each request queued as validated."""
    from fastapi.testclient import TestClient

    made, queued = [], []
    engine = llm.engine
    make, enqueue = engine.make_request, engine.enqueue

    def counted(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    engine.make_request = counted
    engine.enqueue = lambda req: (queued.append(req), enqueue(req))
    try:
        with TestClient(build_app(AsyncEngine(engine), ServerSettings(served_model_names=["tiny"]))) as http:
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 2, "ignore_eos": True})
    finally:
        del engine.make_request, engine.enqueue
    assert r.status_code == 200, r.text
    response_id = r.json()["id"]
    assert sorted(req.request_id for req in made) == [f"{response_id}-0", f"{response_id}-1"]
    assert sorted(map(id, queued)) == sorted(map(id, made))


class FigureOnlyClient:
    """An engine that serves nothing and reports fixed figures: what the server needs of any
    engine beyond the two here (a replica set, a GPU engine) is the protocol alone."""

    def __init__(self) -> None:
        source = open_model("dummy:tiny")
        vocab = source.arch.vocab_size
        self.served_model = ServedModel("figures", source.tokenizer, vocab, 64,
                                        GrammarCompiler(source.tokenizer, vocab), source.arch.hidden_size)
        self.step_listeners: list = []
        self.death_listeners: list = []
        self.metric_collectors = ()
        self.error = None
        self.degraded = None
        self.num_in_flight = 0
        self.started = False

    @property
    def healthy(self) -> bool:
        return self.started

    def start(self) -> None:
        self.started = True

    def stop(self, timeout: float = 10.0) -> None:
        self.started = False

    def stop_accepting(self) -> None:
        pass

    def step_running_for(self) -> float:
        return 0.0

    def declare_dead(self, exc: BaseException) -> None:
        self.error = exc

    def make_request(self, spec: RequestSpec) -> Request:
        raise InvalidRequestError("this engine serves no requests", "prompt")

    def submit(self, request: Request) -> asyncio.Queue:
        raise EngineDeadError("this engine serves no requests")

    def generate(self, spec: RequestSpec):
        return stream_outputs(self, spec)

    def abort(self, request_id: str) -> None:
        pass

    def abort_all(self) -> None:
        pass

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(num_running=1, num_waiting=3, num_in_flight=4, kv_total_blocks=10,
                              kv_used_blocks=4, kv_free_blocks=6, kv_cached_blocks=2,
                              prefix_queried_tokens=100, prefix_hit_tokens=40,
                              counters=EngineCounters(steps=7, finished={"stop": 2}))

    async def self_check(self, timeout: float = 30.0) -> dict:
        return {"ok": True}

    def live_batch(self) -> None:
        return None


def test_the_server_needs_only_the_protocol():
    from fastapi.testclient import TestClient

    client = FigureOnlyClient()
    assert isinstance(client, EngineClient) and _shape_problems(FigureOnlyClient) == []
    with TestClient(build_app(client, ServerSettings())) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["figures"]
        metrics = http.get("/metrics").text
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert http.get("/dashboard").status_code == 404
    for line in ('travelator_num_requests_waiting{model_name="figures"} 3.0',
                 'travelator_kv_cache_usage{model_name="figures"} 0.4',
                 'travelator_kv_cache_cached_blocks{model_name="figures"} 2.0',
                 'travelator_prefix_cache_hit_tokens_total{model_name="figures"} 40.0',
                 'travelator_engine_steps_total{model_name="figures"} 7.0',
                 'travelator_request_success_total{finished_reason="stop",model_name="figures"} 2.0'):
        assert line in metrics
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert not client.started  # the lifespan stopped it
