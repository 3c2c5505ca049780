"""One rank's stage of a pipeline-parallel model (inter-layer parallelism, as in Orca and
vLLM): which contiguous layers it holds, and the point-to-point traffic between stages.

Rank 0 (the driver) holds the embedding and the first layers; the last rank the last layers,
the final norm and the LM head (and, with tied embeddings, its own copy of the embedding as
the head). Each step every rank runs the same flat batch: a stage receives the residual
stream and the last block's un-added output from the stage before it, runs its layers, and
sends both on; the last stage sends the logits of the rows the driver samples back to rank
0. The tensors travel over the group's data group (gloo on CPU), the step messages over its
control group, exactly as with tensor parallelism (``tp_group``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from travelator.model.tp_group import TPGroup

_HIDDEN_TAG = 1
_LOGITS_TAG = 2


def stage_bounds(num_layers: int, size: int, rank: int) -> tuple[int, int]:
    """The layers [start, end) of ``rank``: contiguous, balanced by count (the first stages
    take one more when ``size`` does not divide ``num_layers``)."""
    if num_layers < size:
        raise ValueError(f"pipeline_parallel_size {size} exceeds the model's {num_layers} layers: "
                         f"each stage needs at least one layer")
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """Rank ``group.rank`` of ``group.size`` stages, holding layers [start, end)."""

    group: TPGroup
    start: int
    end: int
    # The driver's receives of logits posted ahead (``expect_logits``), oldest first.
    _posted: deque[tuple[torch.Tensor, Any]] = field(default_factory=deque, compare=False)

    @staticmethod
    def of(group: TPGroup, num_layers: int) -> PipelineStage:
        return PipelineStage(group, *stage_bounds(num_layers, group.size, group.rank))

    @property
    def is_first(self) -> bool:
        return self.group.rank == 0

    @property
    def is_last(self) -> bool:
        return self.group.rank == self.group.size - 1

    def holds_layer(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def holds_embedding(self, tied: bool) -> bool:
        """The first stage embeds; with tied embeddings the last one's head is the embedding."""
        return self.is_first or (tied and self.is_last)

    # ---- between stages ---------------------------------------------------------------
    def receive_hidden(self, rows: int, hidden_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream and the previous block's output, from the stage before."""
        buf = torch.empty(2, rows, hidden_size, dtype=dtype, device=self.group.device)
        self.group.data.recv([buf], self.group.rank - 1, _HIDDEN_TAG).wait()
        return buf[0], buf[1]

    def send_hidden(self, x: torch.Tensor, delta: torch.Tensor) -> None:
        self.group.data.send([torch.stack((x, delta))], self.group.rank + 1, _HIDDEN_TAG).wait()

    def send_logits(self, logits: torch.Tensor) -> None:
        """The last stage's logits, to the driver, which samples."""
        self.group.data.send([logits.contiguous()], 0, _LOGITS_TAG).wait()

    def expect_logits(self, rows: list[int], vocab_size: int, dtype: torch.dtype) -> None:
        """Post the driver's receives of a step's logits (``rows`` per message, in the order the
        last stage sends them) before they are read: with steps in flight the driver sends the
        next step before it reads this one's, and the last stage must be able to send meanwhile
        (a gloo send waits for its receive)."""
        for n in rows:
            buf = torch.empty(n, vocab_size, dtype=dtype, device=self.group.device)
            self._posted.append((buf, self.group.data.recv([buf], self.group.size - 1, _LOGITS_TAG)))

    def receive_logits(self, rows: int, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
        if self._posted:
            buf, work = self._posted.popleft()
            if tuple(buf.shape) != (rows, vocab_size):
                raise RuntimeError(f"pipeline logits of {tuple(buf.shape)} posted, {(rows, vocab_size)} read")
            work.wait()
            return buf
        buf = torch.empty(rows, vocab_size, dtype=dtype, device=self.group.device)
        self.group.data.recv([buf], self.group.size - 1, _LOGITS_TAG).wait()
        return buf
