"""Pipeline stages on the simulated clock.

Each stage computes one step (a micro-batch) at a time; a step enters stage 0 when it is
free, passes through the stages in order (waiting for a stage still busy with the step
before it, and for the send of its activations between two stages, which occupies no stage),
and its tokens land when it leaves the last one. With one stage a step simply takes its time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from travelator.engine.scheduler_output import RunnerOutput, SchedulerOutput
from travelator.sim.cost_model import StageTimes


@dataclass(frozen=True, slots=True)
class Flight:
    """A step sent into the pipeline: what it computes, the samples its tokens will be, when it
    entered stage 0 and how long until it leaves the last (waits for busy stages included)."""

    out: SchedulerOutput
    sampled: RunnerOutput
    start: float
    seconds: float

    @property
    def end(self) -> float:
        return self.start + self.seconds


class Pipeline:
    def __init__(self, stages: int) -> None:
        if stages < 1:
            raise ValueError("a pipeline needs at least one stage")
        self.free_at = [0.0] * stages  # when each stage is done with the steps sent so far
        self.flights: deque[Flight] = deque()  # oldest first: they land in the order sent

    @property
    def stages(self) -> int:
        return len(self.free_at)

    def send(self, out: SchedulerOutput, sampled: RunnerOutput, times: StageTimes, now: float) -> Flight:
        """Send a step into stage 0 at ``now`` (or when stage 0 is free) and book every stage
        for it in turn."""
        if len(times.stages) != self.stages:
            raise ValueError(f"a step timed over {len(times.stages)} stages, the pipeline has {self.stages}")
        start = max(now, self.free_at[0])
        elapsed = 0.0
        for s, seconds in enumerate(times.stages):
            if s:
                elapsed += times.send
            elapsed += max(self.free_at[s] - (start + elapsed), 0.0) + seconds
            self.free_at[s] = start + elapsed
        flight = Flight(out, sampled, start, elapsed)
        self.flights.append(flight)
        return flight

    def land(self) -> Flight:
        """The oldest step in flight, whose tokens are back."""
        return self.flights.popleft()
