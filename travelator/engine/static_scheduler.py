"""Request-level (static) batching, the baseline of the Orca paper.

A batch of up to ``max_num_seqs`` waiting requests is admitted only when the
previous batch has completely finished; nobody joins in between, so the seats of
requests that finish early stay empty until the longest one is done. Same
interface, same model runner and kernels as the iteration-level scheduler: in a
comparison the scheduling policy is the only variable.
"""

from __future__ import annotations

from travelator.engine.request import RequestStatus
from travelator.engine.scheduler import SchedulerBase
from travelator.engine.scheduler_output import SchedulerOutput


class StaticScheduler(SchedulerBase):
    def schedule(self) -> SchedulerOutput:
        out = self._start_output()
        if not self.running:
            self._admit_batch()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget)
            known = len(self.kv.block_ids(req.request_id))
            while not self._try_allocate(req, n):
                # Out of blocks: the latest member leaves the batch and is recomputed
                # in a later batch.
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            else:
                self._add_to_output(out, req, n, known)
                budget -= n
                i += 1
        return out

    def _admit_batch(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
