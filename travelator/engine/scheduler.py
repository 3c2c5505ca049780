"""What every scheduler shares: the queues, block allocation for a step, preemption, abort,
and the update of requests from a step's result. Iteration-level scheduling (Orca's idea: who
computes what is decided anew at every step) is built on it in ``iteration_scheduler``, static
and dynamic batching in ``static_scheduler``.

Plain Python, no torch: the scheduler is tested in milliseconds.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

from travelator.config import SchedulerConfig
from travelator.engine.block_manager import KVCacheManager, blocks_for
from travelator.engine.request import Request, RequestStatus, Stop
from travelator.engine.speculation import Speculator, record_speculation
from travelator.engine.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    RunnerOutput,
    SampledToken,
    ScheduledDrafts,
    SchedulerOutput,
)


class SchedulerBase:
    """What every scheduler shares: queues, the step update, preemption, abort."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock  # what a queueing delay is measured on (a step counter in tests)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_by_runner: set[str] = set()
        self._freed: list[str] = []
        # Finished requests whose blocks are kept until the engine has read them out.
        self._handoffs: list[Request] = []
        # Pipeline parallelism: requests in a step still in flight (scheduled, tokens not yet
        # back). Never scheduled, preempted or announced freed until their step returns.
        self._in_flight: set[str] = set()
        self._freed_in_flight: list[str] = []
        self.micro_batches = 1  # steps the engine keeps in flight (set_micro_batches)
        self.num_preemptions = 0
        self.num_admitted = 0  # requests scheduled for the first time, so far
        self._arrivals = itertools.count()
        self.speculator = Speculator(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
            config.speculative_policy == "adaptive", config.speculation_saturation_rows,
            by_model=config.speculative_method == "draft",
        ) if config.speculative_method is not None else None

    # ---- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self._in_flight:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.arrival_order = next(self._arrivals)
        request.times.queued = self.clock()
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def seconds_until_admission(self) -> float | None:
        """How long the scheduler holds its waiting requests back on purpose, with nobody
        running (dynamic batching: until the batch fills or the delay ends); None when it
        does not. The step loop sleeps this long, or until a request arrives."""
        return None

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (abort, error). Unknown ids are ignored."""
        assert status.finished
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._release(req)
            done.append(req)
        return done

    def _release(self, req: Request) -> None:
        req.times.finished = time.monotonic()
        if req.hand_off and req.status == RequestStatus.FINISHED_LENGTH:
            self._handoffs.append(req)  # its blocks stay until take_handoffs
        else:
            self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._forget_in_runner(req.request_id)

    def take_handoffs(self) -> list[Request]:
        """Requests that finished their part here and whose blocks wait to be read out; the
        caller frees the blocks (``kv.free``) once it has."""
        out, self._handoffs = self._handoffs, []
        return out

    def _forget_in_runner(self, request_id: str) -> None:
        if request_id in self._known_by_runner:
            self._known_by_runner.discard(request_id)
            # The runner still samples an in-flight step's rows: it forgets them after.
            freed = self._freed_in_flight if request_id in self._in_flight else self._freed
            freed.append(request_id)

    # ---- steps in flight (pipeline parallelism) ---------------------------------------
    def start_flight(self, out: SchedulerOutput) -> None:
        """``out`` has been sent off and its tokens are not back: its requests sit out the
        next schedules (their blocks stay theirs) until ``update_from_output`` of ``out``."""
        self._in_flight.update(out.num_scheduled_tokens)

    def end_flight(self, out: SchedulerOutput) -> None:
        """``out``'s tokens are back (or it failed): its requests may be scheduled again, and
        those finished meanwhile are announced freed to the runner."""
        self._in_flight.difference_update(out.num_scheduled_tokens)
        still = [rid for rid in self._freed_in_flight if rid in self._in_flight]
        self._freed.extend(rid for rid in self._freed_in_flight if rid not in self._in_flight)
        self._freed_in_flight = still

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def set_micro_batches(self, n: int) -> None:
        """The engine keeps up to ``n`` steps in flight: each step then takes its share of the
        requests, so that every stage of the pipeline has a micro-batch to compute."""
        if n < 1:
            raise ValueError("micro_batches must be positive")
        self.micro_batches = n

    def _step_has_room(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` may take one more request (its share, with micro-batches)."""
        if self.micro_batches == 1:
            return True
        share = -(-(len(self.running) + len(self.waiting)) // self.micro_batches)
        return len(out.num_scheduled_tokens) < share

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and put it back to wait."""
        self._release_blocks(req)
        self._requeue(req)

    def _release_blocks(self, req: Request) -> None:
        """Free the request's blocks; it recomputes prompt + outputs when it resumes."""
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._forget_in_runner(req.request_id)

    def _requeue(self, req: Request) -> None:
        """Put a preempted request back where it waits (FCFS: the front)."""
        self.waiting.appendleft(req)

    # ---- one step -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    def _schedule_tokens(self, req: Request, budget: int, reserve_all: bool = False) -> int | None:
        """Allocate blocks for the request's next tokens within ``budget``.

        A request holding no blocks first takes its cached prefix. With
        ``reserve_all`` it gets blocks for all its known tokens at once (a resumed
        request: its recompute then never asks for blocks, so it cannot be the one
        that triggers a preemption before it makes progress). Returns the number of
        tokens to compute, or None (changing nothing) when the pool is too full.
        """
        cached: list[int] = []
        computed = req.num_computed_tokens
        if computed == 0 and not self.kv.block_ids(req.request_id):
            cached = self.kv.find_cached_prefix(req)
            computed = len(cached) * self.kv.block_size
        n = min(req.num_tokens - computed, budget)
        target = req.num_tokens if reserve_all else computed + n
        if self.kv.allocate_slots(req, target, cached) is None:
            return None
        if req.num_computed_tokens == 0 and req.num_preemptions == 0:
            req.num_cached_prompt_tokens = computed
            self.kv.record_lookup(req.num_prompt_tokens, computed)
        req.num_computed_tokens = computed
        return n

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Schedule running requests in order, preempting when blocks run out.

        Returns the budget left and whether anything was preempted.
        """
        preempted = False
        order = [r for r in self.running if r.request_id not in self._in_flight]
        i = 0
        while i < len(order) and budget > 0 and self._step_has_room(out):
            req = order[i]
            known = len(self.kv.block_ids(req.request_id))
            drafts, k = self._drafts(req, budget)
            if k:
                self._add_to_output(out, req, 1 + k, known)
                out.drafts[req.request_id] = ScheduledDrafts(k, drafts)
                budget -= 1 + k
                i += 1
                continue
            n = self._schedule_tokens(req, budget)
            while n is None:
                victim = self._pick_victim(order, i)
                if victim is req and self._in_flight:
                    break  # blocks come back with the steps in flight: it waits for them
                order.remove(victim)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                out.num_preempted += 1
                if victim is req:
                    break
                n = self._schedule_tokens(req, budget)
            if n is None:
                i += req in order  # preempted: order[i] is now the next one; waiting: skipped
                continue
            self._add_to_output(out, req, n, known)
            budget -= n
            i += 1
        return budget, preempted

    def _drafts(self, req: Request, budget: int) -> tuple[list[int], int]:
        """Speculative decoding: how many drafts a decoding request verifies, and which (none
        listed when a draft model proposes them in the runner), with blocks allocated for
        them (none when the pool has no room: it then decodes as usual)."""
        req.speculation_probe = None
        spec = self.speculator
        if (spec is None or req.num_computed_tokens != req.num_tokens - 1 or spec.saturated(len(self.running))
                or not self.kv.block_ids(req.request_id) or not spec.eligible(req)):
            return [], 0
        # No drafts past max_tokens: each accepted one is an output token.
        room = max(min(budget - 1, req.max_tokens - len(req.output_token_ids) - 1), 0)
        k = min(spec.length(req, len(self.running)), room)
        # n-gram: the proposal itself, or one token to probe acceptance with.
        proposal = [] if spec.by_model or room == 0 else spec.propose(req, max(k, 1))
        if not spec.by_model:
            k = min(k, len(proposal))
        if k == 0:
            req.speculation_probe = proposal[0] if proposal else None
            return [], 0
        # Drafts are optional: not when the pool is nearly full (the blocks they take could
        # make a later running request preempt another to decode at all).
        extra = blocks_for(req.num_tokens + k, self.kv.block_size) - len(self.kv.block_ids(req.request_id))
        if self.kv.num_free_blocks - extra < len(self.running) or self.kv.allocate_slots(req, req.num_tokens + k) is None:
            return [], 0
        return proposal[:k], k

    def _pick_victim(self, order: list[Request], i: int) -> Request:
        """The request to preempt so that order[i] can go on (``order``: the running requests
        this step may schedule, none in flight).

        Only requests not yet scheduled this step qualify, least important first. A
        request that was preempted and has not produced a token since is spared: if
        every later request is such a one, order[i] yields itself instead (it is
        never one itself, since a resumed request holds blocks for its whole
        recompute and asks for none until it has produced a token).
        """
        later = order[i + 1:]
        spared = [r for r in later if not r.resumed_without_progress]
        if spared:
            return self._least_important(spared)
        req = order[i]
        if later and req.resumed_without_progress:  # cannot happen; never deadlock if it does
            return self._least_important(later)
        return req

    def _least_important(self, candidates: list[Request]) -> Request:
        return candidates[-1]  # the most recently admitted

    @property
    def pending_freed_ids(self) -> list[str]:
        """Requests freed since the last step, which the runner has yet to be told to forget
        (those of a step in flight: once it lands)."""
        return self._freed + self._freed_in_flight

    def return_freed(self, request_ids: list[str]) -> None:
        """A step failed before the runner saw them: announce these ids again next step."""
        self._freed.extend(request_ids)

    def _start_output(self) -> SchedulerOutput:
        out = SchedulerOutput(freed_request_ids=self._freed)
        self._freed = []
        return out

    def _add_to_output(self, out: SchedulerOutput, req: Request, num_new_tokens: int,
                       known_blocks: int) -> None:
        """Record that ``req`` computes ``num_new_tokens`` this step.

        ``known_blocks`` is how many of its blocks the runner already knows about.
        """
        rid = req.request_id
        blocks = self.kv.block_ids(rid)
        if rid in self._known_by_runner:
            out.cached_requests.append(
                CachedRequestData(rid, blocks[known_blocks:], req.num_computed_tokens)
            )
        else:
            out.new_requests.append(
                NewRequestData(
                    rid,
                    req.prompt_token_ids,
                    list(req.output_token_ids),
                    req.sampling_params,
                    list(blocks),
                    req.num_computed_tokens,
                )
            )
            self._known_by_runner.add(rid)
        out.num_scheduled_tokens[rid] = num_new_tokens
        # A decode computes the one token it sampled last (and its drafts); anything else
        # is prompt (or recomputed output) being prefilled.
        if req.num_computed_tokens == req.num_tokens - 1:
            out.num_decodes += 1
        else:
            out.num_prefill_tokens += num_new_tokens
            out.prefill_request_ids.append(rid)
        if req.times.first_scheduled is None:
            req.times.first_scheduled = time.monotonic()
            self.num_admitted += 1

    def _computed(self, req: Request) -> None:
        """The request's num_computed_tokens has advanced: key its newly full blocks for the
        prefix cache, then give back those its remaining queries' windows leave behind
        (a sliding-window model: KVCacheManager.release_out_of_window)."""
        self.kv.cache_full_blocks(req)
        self.kv.release_out_of_window(req)

    def update_from_output(
        self, out: SchedulerOutput, result: RunnerOutput
    ) -> list[tuple[Request, list[SampledToken]]]:
        """Advance every scheduled request and append the tokens it got. Returns each that got
        tokens, with them (several under speculative decoding), and each that finished its
        prompt with ``max_tokens=0``, with none: whether they stop is decided after
        detokenizing (``OutputProcessor``), and comes back through ``stop_request``."""
        self.end_flight(out)
        now = time.monotonic()
        updated = []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            drafts = out.num_drafts(rid)
            toks = result.tokens_of(rid)
            # Valid KV: what was computed, less the drafts its own samples refused.
            req.num_computed_tokens += n - (drafts - max(len(toks) - 1, 0))
            if (plp := result.prompt_logprobs.get(rid)) is not None:
                req.add_prompt_logprobs(plp.first, plp.logprobs, plp.top_logprobs, plp.ranks)
            if (pooled := result.pooled.get(rid)) is not None:
                req.pooled = pooled
            if not toks:
                self._computed(req)
                continue  # a prompt chunk that does not reach the end of the prompt
            req.resumed_without_progress = False
            if req.max_tokens == 0:  # the prompt was all it asked for: drop the sample
                toks = []
            else:
                record_speculation(req, drafts, toks[0].token_id, len(toks) - 1)
                for tok in toks:
                    req.append_output_token(tok.token_id)
            assert req.num_computed_tokens == req.num_tokens - bool(toks)
            self._computed(req)
            if req.times.first_token is None:
                req.times.first_token = now
            req.times.last_token = now
            updated.append((req, toks))
        return updated

    def stop_request(self, req: Request, num_dropped: int, stop: Stop) -> None:
        """``req`` ends: its last ``num_dropped`` output tokens, which came after the one that
        ended it, go; then it finishes as ``finish_requests`` does."""
        if num_dropped:
            del req.output_token_ids[-num_dropped:]
        # Its last kept token may be an accepted draft, whose KV is valid.
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        req.stop_reason = stop.reason
        self.finish_requests([req.request_id], stop.status)
