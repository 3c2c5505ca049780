"""Request-level batching, the baselines of the Orca paper: a batch runs to completion.

Static batching (FasterTransformer): the waiting requests, up to ``max_num_seqs``, form a
batch as soon as the previous batch has completely finished. Dynamic batching (Triton
Inference Server, TF Serving): the same, except that a batch also waits until it is full or
its first request has waited ``max_queue_delay_ms``. Either way nobody joins a running batch,
so the seats of requests that finish early stay empty until the longest one is done. Same
interface, same model runner and kernels as the iteration-level schedulers: in a comparison
the batching is the only variable.
"""

from __future__ import annotations

from travelator.engine.request import RequestStatus
from travelator.engine.scheduler import SchedulerBase
from travelator.engine.scheduler_output import SchedulerOutput


class StaticScheduler(SchedulerBase):
    def schedule(self) -> SchedulerOutput:
        out = self._start_output()
        if not self.running and self._batch_ready():
            self._admit_batch()
        # Out of blocks: the latest member leaves the batch and is recomputed later.
        self._schedule_running(out, self.config.max_num_batched_tokens)
        return out

    def _batch_ready(self) -> bool:
        return True

    def _admit_batch(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)


class DynamicScheduler(StaticScheduler):
    """Static batching that waits for a full batch, up to ``max_queue_delay_ms``.

    The delay counts from when the oldest waiting request reached the scheduler. A
    preempted request waits at the front again, under its first queueing time, so it
    never waits twice.
    """

    def _batch_ready(self) -> bool:
        return self.seconds_until_admission() == 0.0

    def seconds_until_admission(self) -> float | None:
        if self.running or not self.waiting:
            return None
        if len(self.waiting) >= self.config.max_num_seqs:
            return 0.0
        oldest = min(r.times.queued for r in self.waiting)
        return max(0.0, oldest + self.config.max_queue_delay_ms / 1000 - self.clock())
