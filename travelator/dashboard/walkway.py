"""The walkway, step by step: who sat where in each step, for the live view (``/dashboard``)
and for replays of a benchmark's runs.

``WalkwayRecorder.record`` runs on the step thread right after a step and turns the engine's
state into one plain, JSON-ready record: each seat of the batch (a row of the picture) with
the request on it and what it did (``p`` a prefill chunk, ``d`` a decode, ``i`` seated but not
scheduled this step), who joined and who left (and why), the queue, the KV pool, and the
latencies of the requests that finished. A request keeps its seat from the step it joins the
running batch to the step it leaves it, so a band in the picture is one request's stay.

Plain Python and cheap: a few dict entries per running request, so it may run at every step.
Counting the pool's cached-free blocks walks the prefix cache, so that figure is refreshed at
most ``kv_refresh_s`` apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from travelator.engine.request import RequestStatus

# Kinds of a seat in one step.
PREFILL, DECODE, IDLE = "p", "d", "i"
QUEUE_SHOWN = 20  # waiting requests listed in a record (all are counted)
PROMPT_CHARS = 200  # of a prompt's text, when prompts may be shown


class WalkwayRecorder:
    def __init__(self, engine, *, show_prompts: bool = False, kv_refresh_s: float = 0.1,
                 rejected: Callable[[], int] = lambda: 0, clock: Callable[[], float] = time.time) -> None:
        """``engine``: an ``LLMEngine`` (its scheduler, KV pool, counters and last step are read).
        ``rejected``: the number of requests refused before reaching the engine, so far."""
        self.engine = engine
        self.show_prompts = show_prompts
        self.kv_refresh_s = kv_refresh_s
        self.rejected = rejected
        self.clock = clock
        self.max_num_seqs = engine.config.scheduler.max_num_seqs
        self.seats: dict[str, int] = {}  # request id -> its seat
        self._free_seats = list(range(self.max_num_seqs - 1, -1, -1))  # a stack: lowest seat first
        # Totals count from here (an engine may have served before: a benchmark's warm-up).
        self._admitted0 = engine.scheduler.num_admitted
        self._preemptions0 = engine.counters.preemptions
        self._cached_free = 0
        self._kv_at = float("-inf")

    def info(self) -> dict:
        """What does not change while the engine serves."""
        e = self.engine
        return {"model": e.model_name, "max_num_seqs": self.max_num_seqs, "num_blocks": e.kv.num_blocks,
                "block_size": e.kv.block_size, "batching": e.config.scheduler.batching,
                "show_prompts": self.show_prompts}

    def record(self, outputs, *, idle: bool = False) -> dict:
        """The step that just ran (``engine.last_step``) and the outputs it produced; with
        ``idle``, no step: the engine has run out of work (aborts may have emptied the batch),
        and the record says so, so that a view does not keep showing the last busy step."""
        e, sched = self.engine, self.engine.scheduler
        stats, out = (None, None) if idle else (e.last_step, e.last_schedule)
        now = self.clock()
        finished = {o.request_id: o for o in outputs if o.finished}
        running = {r.request_id: r for r in sched.running}
        scheduled = out.num_scheduled_tokens if out is not None else {}
        prefilling = set(out.prefill_request_ids) if out is not None else set()
        # Drawn in this step: who ran in it (finished by it or not), and who sits without running.
        members = [*scheduled, *(rid for rid in running if rid not in scheduled)]
        # Seats of those who left before the step (preempted or aborted) are free for it.
        left = self._release([r for r in self.seats if r not in running and r not in scheduled], finished)
        joined, prompts, seats, requests = [], {}, [], {}
        for rid in members:
            req = running.get(rid) or sched.requests.get(rid)
            if rid not in self.seats:
                self.seats[rid] = self._free_seats.pop()
                joined.append(rid)
                if self.show_prompts and (ids := _prompt_ids(req, finished.get(rid))):
                    prompts[rid] = e.tokenizer.decode(ids[:PROMPT_CHARS])[:PROMPT_CHARS]  # a token is a character or more
            n = scheduled.get(rid, 0)
            kind = IDLE if n == 0 else PREFILL if rid in prefilling else DECODE
            seats.append([self.seats[rid], rid, kind, n])
            if req is not None:
                requests[rid] = [req.num_prompt_tokens, len(req.output_token_ids), req.status.value,
                                 req.priority, len(e.kv.held_block_ids(rid))]
            elif (o := finished.get(rid)) is not None:
                requests[rid] = [len(o.prompt_token_ids), len(o.output_token_ids), o.finish_reason, None, 0]
        left += self._release([r for r in self.seats if r not in running], finished)  # ended by this step
        waiting = list(sched.waiting)
        t_mono = time.monotonic()
        kv = e.kv
        if idle or now - self._kv_at >= self.kv_refresh_s:  # at rest it is exact
            self._cached_free, self._kv_at = kv.count_cached_free_blocks(), now
        cached_free = min(self._cached_free, kv.num_free_blocks)
        return {
            "step": e.counters.steps, "t": now, "ms": round(stats.duration_s * 1000, 3) if stats else 0.0,
            "seats": seats, "joined": joined, "left": left, "requests": requests,
            "tokens": stats.num_tokens if stats else 0,
            "prefill_tokens": stats.num_prefill_tokens if stats else 0,
            "generated": sum(len(o.new_token_ids) for o in outputs),
            "finished": [_latencies(o) for o in finished.values()],
            "waiting": len(waiting),
            "queue": [[r.request_id, round(t_mono - r.times.arrival, 3), r.priority] for r in waiting[:QUEUE_SHOWN]],
            "oldest_wait_s": round(max((t_mono - r.times.arrival for r in waiting), default=0.0), 3),
            "kv": {"used": kv.num_used_blocks, "cached_free": cached_free,
                   "free": kv.num_free_blocks - cached_free, "total": kv.num_blocks},
            "admitted_total": sched.num_admitted - self._admitted0, "rejected_total": self.rejected(),
            "preemptions_total": e.counters.preemptions - self._preemptions0, "prompts": prompts, "idle": idle,
        }

    def _release(self, request_ids: list[str], finished: dict) -> list[list]:
        """Free the seats of requests off the walkway: [id, seat, why] for each."""
        left = []
        for rid in request_ids:
            seat = self.seats.pop(rid)
            self._free_seats.append(seat)
            left.append([rid, seat, self._why_left(finished.get(rid), self.engine.scheduler.requests.get(rid))])
        self._free_seats.sort(reverse=True)
        return left

    @staticmethod
    def _why_left(output, req) -> str:
        if output is not None:
            return output.finish_reason or "finished"
        if req is not None and req.status == RequestStatus.PREEMPTED:
            return "preempted"
        return "abort"  # gone without a finishing output: aborted (or failed with its step)


def _prompt_ids(req, output) -> list[int]:
    if req is not None:
        return req.prompt_token_ids
    return output.prompt_token_ids if output is not None else []


def _latencies(o) -> list:
    """[id, TTFT s, TPOT s, end-to-end s, output tokens] of a finished request."""
    t = o.times
    n = len(o.output_token_ids)
    if t is None or t.first_token is None:
        return [o.request_id, None, None, None, n]
    end = t.finished or t.last_token or t.first_token
    tpot = (t.last_token - t.first_token) / (n - 1) if n > 1 and t.last_token else None
    return [o.request_id, round(t.first_token - t.arrival, 4), None if tpot is None else round(tpot, 5),
            round(end - t.arrival, 4), n]
