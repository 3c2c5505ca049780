"""The seam between the engine and whatever runs the model.

One rank: a ``ModelRunner``. Tensor parallel: the driver of the group (``TPExecutor``), which
runs its own shard and tells the workers to run theirs. The engine, the step loop's
self-check and the metrics use only this interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

from travelator.engine.scheduler_output import RunnerOutput, SchedulerOutput


class Executor(Protocol):
    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block takes on this rank (a rank holds its share of the KV heads)."""
        ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the paged KV cache (on every rank)."""
        ...

    def describe(self) -> str:
        """The dtype and kernel routes chosen (the driver's rank), in one line."""
        ...

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Apply the step's changes (even an empty step carries freed ids) and run it."""
        ...

    @property
    def phase_times(self) -> dict[str, float]:
        """Seconds spent per phase of the model step, summed since start (the driver's)."""
        ...

    def read_kv_blocks(self, block_ids: list[int]) -> "torch.Tensor":
        """The blocks' K and V in every layer, on the CPU (a KV hand-off)."""
        ...

    def write_kv_blocks(self, block_ids: list[int], data: "torch.Tensor") -> None:
        """Write another engine's ``read_kv_blocks`` output into these blocks."""
        ...

    def held_request_ids(self) -> set[str]:
        """Ids of the requests whose state the runner keeps, on any rank: for leak checks."""
        ...

    def shutdown(self) -> None:
        """Stop what the executor started (workers); idempotent."""
        ...


class PipelinedExecutor(Executor, Protocol):
    """A pipeline's driver (``TPExecutor`` over stages): steps sent off and landed in order, so
    that several are in flight at once."""

    def launch(self, out: SchedulerOutput) -> None:
        """Apply the step's changes and send it through the stages; do not wait for its tokens."""
        ...

    def land(self) -> RunnerOutput:
        """The tokens of the oldest step launched and not landed."""
        ...
