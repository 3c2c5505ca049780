"""Where each request of a disaggregated server is, and what the client gets: the front end's
state machine, without processes or an event loop (``DisaggregatedFrontEnd`` drives it; the
tests drive it by hand).

A request (``Route``) waits here until some decode worker has room for its KV (``Placement``:
the backpressure), then ``Expect`` goes to that decode worker and ``Submit`` to a prefill
worker. The prefill worker's output is the first token, passed on marked unfinished; the decode
worker's outputs follow. Those can overtake it (two processes, two pipes): they wait in the
route until the first token has gone out. A worker that dies fails the requests it held, and
the other side of each is told to let go.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from travelator.disagg import messages as m
from travelator.disagg.placement import Placement
from travelator.engine.block_manager import blocks_for
from travelator.engine.outputs import RequestOutput
from travelator.engine.request import Request, RequestTimes

PREFILL_STAGE, DECODE_STAGE, WAITING_STAGE = "prefill", "decode", "waiting"


@dataclass(slots=True)
class Route:
    request: Request
    stage: str = WAITING_STAGE
    prefill: int | None = None
    decode: int | None = None  # None: it ends at its first token
    client_gone: bool = False
    first_text: str = ""  # the text the prefill worker released (what a failed request had)
    num_cached_tokens: int = 0  # prompt tokens the prefill worker found in its prefix cache
    prompt_logprobs: list | None = None  # computed by the prefill worker
    early: list[RequestOutput] = field(default_factory=list)  # decode outputs that overtook the first token
    times: RequestTimes | None = None


class Router:
    def __init__(self, placement: Placement, block_size: int, send: Callable[[m.WorkerId, object], None],
                 push: Callable[[str, RequestOutput], None]) -> None:
        self.placement = placement
        self.block_size = block_size
        self._send = send  # a command to a worker
        self._push = push  # an output to the client
        self.routes: dict[str, Route] = {}
        self.waiting: deque[str] = deque()
        self.finished: dict[str, int] = {}  # finish reasons the clients saw

    # ---- requests --------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.routes:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.routes[req.request_id] = Route(req, times=RequestTimes(arrival=req.times.arrival))
        self.waiting.append(req.request_id)
        self.dispatch()

    def abort(self, request_id: str) -> None:
        """The client went away: stop the request wherever it is, and tell it nothing more."""
        route = self.routes.get(request_id)
        if route is None:
            return
        route.client_gone = True
        if route.stage == WAITING_STAGE:
            self.waiting.remove(request_id)
            self._close(request_id)
            return
        if route.decode is not None:  # a KV on its way there is dropped when it comes
            self._send(m.WorkerId(m.DECODE, route.decode), m.Abort(request_id))
        if route.stage == PREFILL_STAGE:  # closed when the prefill worker's last output comes
            self._send(m.WorkerId(m.PREFILL, route.prefill), m.Abort(request_id))
        else:  # the decode worker lets go of it by itself, whatever stage it is at there
            self._close(request_id)

    def dispatch(self) -> None:
        """Send waiting requests on, first come first served, while a decode worker has room."""
        while self.waiting:
            route = self.routes[self.waiting[0]]
            req = route.request
            prefill = self.placement.choose_prefill()
            if prefill is None:
                return
            decode = None
            if req.max_tokens > 1:
                need = blocks_for(req.num_prompt_tokens + 1, self.block_size)
                decode = self.placement.choose_decode(need)
                if decode is None:
                    return  # backpressure: it waits for a decode worker's report
                self.placement.promise(decode, req.request_id, need)
                self._send(m.WorkerId(m.DECODE, decode),
                           m.Expect(req.request_id, req.sampling_params, req.priority, prefill))
            self.waiting.popleft()
            route.stage, route.prefill, route.decode = PREFILL_STAGE, prefill, decode
            self.placement.prefill_sent(prefill, req.request_id, req.num_prompt_tokens)
            self._send(m.WorkerId(m.PREFILL, prefill),
                       m.Submit(req.request_id, req.prompt_token_ids, req.sampling_params, req.priority,
                                req.cache_salt, decode))

    # ---- what the workers report -------------------------------------------------------------
    def on_report(self, rep: m.Report) -> list[RequestOutput]:
        """Take one worker's report; the outputs passed on to clients (also pushed)."""
        w = rep.worker
        if w.role == m.DECODE:
            self.placement.report(w.index, rep.stats.free_blocks, rep.stats.running)
            for rid in rep.admitted:
                self.placement.release(w.index, rid)
        handed_off = set(rep.handed_off)
        delivered: list[RequestOutput] = []
        for out in rep.outputs:
            route = self.routes.get(out.request_id)
            if route is None:
                continue  # closed already (failed elsewhere, or an abort's echo)
            if w.role == m.PREFILL:
                outs = self._from_prefill(route, out, out.request_id in handed_off)
            elif route.stage == PREFILL_STAGE:
                route.early.append(out)  # it overtook the first token: keep it until then
                continue
            else:
                outs = self._from_decode(route, out)
            for o in outs:
                delivered.append(o)
                self._push(o.request_id, o)
        for rid, why in rep.failed.items():
            if (route := self.routes.get(rid)) is not None:
                self.fail(route, f"{w}: {why}")
        self.dispatch()
        return delivered

    def _from_prefill(self, route: Route, out: RequestOutput, handed_off: bool) -> list[RequestOutput]:
        rid = out.request_id
        self._merge_times(route, out)
        if not out.finished:
            return [] if route.client_gone else [out]
        self.placement.prefill_done(route.prefill, rid)
        route.num_cached_tokens = out.num_cached_tokens
        route.prompt_logprobs = out.prompt_logprobs
        if handed_off:
            route.stage, route.first_text = DECODE_STAGE, out.text
            out.finished, out.finish_reason = False, None
            if route.client_gone:  # the decode worker drops the KV when it comes
                self._close(rid)
                return []
            early, route.early = route.early, []
            return [out] + [o for e in early for o in self._from_decode(route, e)]
        if route.decode is not None:  # no KV will come: it ended at its first token
            self._send(m.WorkerId(m.DECODE, route.decode), m.Forget(rid))
        self._close(rid)
        return [] if route.client_gone else [self._finished(out)]

    def _from_decode(self, route: Route, out: RequestOutput) -> list[RequestOutput]:
        if route.request.request_id not in self.routes:
            return []  # finished by an earlier output of the same batch
        out.num_cached_tokens = route.num_cached_tokens
        out.prompt_logprobs = route.prompt_logprobs
        self._merge_times(route, out)
        if out.finished:
            self._close(out.request_id)
            return [] if route.client_gone else [self._finished(out)]
        return [] if route.client_gone else [out]

    @staticmethod
    def _merge_times(route: Route, out: RequestOutput) -> None:
        """One request's moments across the two workers (one machine: one monotonic clock)."""
        t, w = route.times, out.times
        if w is not None:
            t.queued = t.queued or w.queued
            t.first_scheduled = t.first_scheduled or w.first_scheduled
            t.first_token = t.first_token or w.first_token
            t.last_token = w.last_token or t.last_token
            t.finished = w.finished if out.finished else None
        out.times = dataclasses.replace(t)

    def _finished(self, out: RequestOutput) -> RequestOutput:
        reason = out.finish_reason or "stop"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        return out

    # ---- failures ----------------------------------------------------------------------------
    def fail(self, route: Route, why: str) -> None:
        """End a request with an error and tell the workers that may hold it to let go."""
        req = route.request
        rid = req.request_id
        if route.stage == PREFILL_STAGE and route.prefill is not None:
            self._send(m.WorkerId(m.PREFILL, route.prefill), m.Abort(rid))
            self.placement.prefill_done(route.prefill, rid)
        if route.decode is not None:
            self._send(m.WorkerId(m.DECODE, route.decode), m.Forget(rid))
        if route.stage == WAITING_STAGE:
            self.waiting.remove(rid)
        self._close(rid)
        if not route.client_gone:
            out = RequestOutput(rid, req.prompt_token_ids, [], route.first_text, finished=True,
                                finish_reason="error", error=why, times=dataclasses.replace(route.times))
            self._push(rid, self._finished(out))

    def on_death(self, worker: m.WorkerId, why: str) -> None:
        """Fail what the worker held; the others go on (``dispatch`` skips it from now on)."""
        self.placement.mark_dead(worker.role, worker.index)
        for route in list(self.routes.values()):
            if worker.role == m.PREFILL:
                held = route.prefill == worker.index and route.stage == PREFILL_STAGE
            else:
                held = route.decode == worker.index
            if held:
                if worker.role == m.DECODE:
                    self.placement.release(worker.index, route.request.request_id)
                    route.decode = None  # nothing to tell a dead worker
                self.fail(route, f"the {worker} died ({why})")
        self.dispatch()

    def _close(self, request_id: str) -> None:
        route = self.routes.pop(request_id, None)
        if route is not None and route.decode is not None:
            self.placement.release(route.decode, request_id)
