"""Request-level (static) batching, the baseline of the Orca paper.

A batch of up to ``max_num_seqs`` waiting requests is admitted only when the
previous batch has completely finished; nobody joins in between, so the seats of
requests that finish early stay empty until the longest one is done. Same
interface, same model runner and kernels as the iteration-level scheduler: in a
comparison the batching is the only variable.
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
        # Out of blocks: the latest member leaves the batch and is recomputed later.
        self._schedule_running(out, self.config.max_num_batched_tokens)
        return out

    def _admit_batch(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
