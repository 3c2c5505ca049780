"""The schedulers of iteration-level batching (Orca's idea), on ``SchedulerBase``'s queues,
preemption and step update: chunked prefill (``IterationScheduler``), whole prompts as Orca
published (``WholePromptScheduler``), and by priority (``PriorityScheduler``).

Plain Python, no torch.
"""

from __future__ import annotations

from travelator.engine.request import Request, RequestStatus
from travelator.engine.scheduler import SchedulerBase
from travelator.engine.scheduler_output import SchedulerOutput


class IterationScheduler(SchedulerBase):
    """Continuous batching with chunked prefill and preemption by recomputation.

    Per step, within ``max_num_batched_tokens`` and ``max_num_seqs``: running
    requests first, in admission order (one token each when decoding, else their next
    prompt chunk), then waiting requests first-come first-served. When the pool is
    out of blocks, the most recently admitted running request is preempted. No new
    request is admitted in a step that had to preempt.

    Admission never blocks forever behind one request: a waiting request that does
    not fit in the free blocks may be overtaken by later ones that do, but at most
    ``max_overtakes`` times; after that nobody is admitted past it until it fits, so
    it cannot starve either.
    """

    def schedule(self) -> SchedulerOutput:
        out = self._start_output()
        budget, preempted = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not preempted:
            self._admit_waiting(out, budget)
            # Not while steps are in flight: their requests, not the pool, may be what is busy.
            while not out.num_scheduled_tokens and not self.num_in_flight and self._release_waiting_blocks(out):
                self._admit_waiting(out, budget)
        return out

    def _release_waiting_blocks(self, out: SchedulerOutput) -> bool:
        """Nothing could be scheduled, and waiting requests hold blocks (handed-off KV,
        ``LLMEngine.add_handoff``): without this the pool would stay full for ever. The
        latest such request gives its blocks up and will recompute, as a preempted one."""
        for req in reversed(self._waiting_order()):
            if self.kv.block_ids(req.request_id):
                self._release_blocks(req)  # it stays where it waits
                out.num_preempted += 1
                return True
        return False

    def _waiting_order(self) -> list[Request]:
        return list(self.waiting)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        blocked: list[Request] = []  # waiting requests that did not fit this step
        for req in self._waiting_order():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or not self._step_has_room(out):
                break
            if any(b.num_overtaken >= self.config.max_overtakes for b in blocked):
                break
            allowed = self._admission_budget(req, budget, out)
            if allowed is None:
                break
            n = self._schedule_tokens(req, allowed, reserve_all=req.status == RequestStatus.PREEMPTED)
            if n is None:
                blocked.append(req)
                continue
            for b in blocked:
                b.num_overtaken += 1
            self.waiting.remove(req)
            if req.status == RequestStatus.PREEMPTED:
                req.resumed_without_progress = True
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_to_output(out, req, n, 0)
            budget -= n

    def _admission_budget(self, req: Request, budget: int, out: SchedulerOutput) -> int | None:
        """The tokens a joining request may compute this step (None: admit nobody more)."""
        return budget  # chunked prefill: whatever the step's budget has left


class WholePromptScheduler(IterationScheduler):
    """Orca as published: iteration-level scheduling, but a joining request computes its
    whole prompt (or, resumed after a preemption, prompt and outputs) in its first step,
    as vLLM did before chunked prefill. A long prompt therefore stalls every running
    decode for one long step.

    The token budget still limits how many prompts join in one step, except that the
    step's first prompt joins whole even when it alone exceeds the budget (otherwise a
    prompt longer than the budget could never run). Joiners stay first-come first-served:
    a prompt that does not fit the budget left stops admission for this step.
    """

    def _admission_budget(self, req: Request, budget: int, out: SchedulerOutput) -> int | None:
        computed = req.num_computed_tokens
        if computed == 0 and not self.kv.block_ids(req.request_id):  # what a cache hit would spare
            computed = len(self.kv.find_cached_prefix(req)) * self.kv.block_size
        whole = req.num_tokens - computed
        if whole <= budget or out.num_prefill_tokens == 0:
            return req.num_tokens  # never limiting: _schedule_tokens computes the rest whole
        return None


class PriorityScheduler(IterationScheduler):
    """Iteration-level scheduling by ``priority`` (lower first, FCFS within a level).

    Running requests are served in priority order; when blocks run out, the
    lowest-priority, latest request is preempted first; waiting requests are
    admitted in priority order.
    """

    @staticmethod
    def _rank(req: Request) -> tuple[int, int]:
        return (req.priority, req.arrival_order)

    def schedule(self) -> SchedulerOutput:
        self.running.sort(key=self._rank)
        return super().schedule()

    def _waiting_order(self) -> list[Request]:
        return sorted(self.waiting, key=self._rank)

    def _least_important(self, candidates: list[Request]) -> Request:
        return max(candidates, key=self._rank)
