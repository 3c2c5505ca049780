"""The ranks of one tensor-parallel engine and the collectives between them.

The groups are built straight from a store (no ``init_process_group``): no process-wide
default group, so several engines can live in one process and a broken one leaves
nothing behind.

Two groups over the same ranks:
- ``data``: the collectives inside the model (all-reduce after the row-parallel
  projections and the embedding, gather of the vocabulary-split logits). gloo on CPU,
  NCCL on CUDA. Its timeout bounds how long a rank waits for a peer inside a step.
- ``ctrl``: gloo, for the driver's step messages (bytes, authenticated by ``tp_auth``
  with the group's secret; what they mean is the engine's). Workers wait on it between
  steps, while the engine may be idle for hours, so it has no practical timeout; a peer
  that dies is still noticed at once (gloo reports the closed connection).
"""

from __future__ import annotations

import datetime
import os
import secrets
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from travelator.model.arch import ModelArch
from travelator.model.tp_auth import NONCE_BYTES, ControlAuth, ControlAuthError, session_id

# How long a rank waits on a peer inside one collective of a step (env override, seconds).
DATA_TIMEOUT_S = float(os.environ.get("TRAVELATOR_TP_TIMEOUT", "600"))
_CTRL_TIMEOUT = datetime.timedelta(days=3650)
# A frame's length arrives before its MAC can be checked: bound what a peer makes us allocate.
MAX_FRAME_BYTES = 1 << 30


class TPGroup:
    """One engine's ranks: ``rank`` of ``size``; rank 0 is the driver. Building it is
    collective, and every rank must prove ``secret`` (``tp_auth``) or the group is refused."""

    def __init__(self, store: dist.Store, rank: int, size: int, secret: bytes) -> None:
        self.rank = rank
        self.size = size
        self._store = store
        self.ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl/", store), rank, size, _CTRL_TIMEOUT)
        session = session_id(self._allgather_bytes(secrets.token_bytes(NONCE_BYTES)))
        self._auth = ControlAuth(secret, rank, size, session)
        self._auth.check_proofs(self._allgather_bytes(self._auth.proof()))
        self.data: Any = None
        self.device = torch.device("cpu")
        # Batch-invariant mode: sum the ranks' parts in rank order (see all_reduce).
        self.fixed_order_sums = False
        # Mixtures of experts: whole experts placed on ranks (``expert_rank``) instead of every
        # expert's intermediate size split over them.
        self.expert_parallel = False

    def expert_rank(self, expert: int) -> int:
        """The rank that holds ``expert`` under expert parallelism: round robin, so that each
        rank holds every size-th expert."""
        return expert % self.size

    def connect_data(self, device: torch.device) -> None:
        """Build the data group for ``device`` (collective: every rank calls it)."""
        timeout = datetime.timedelta(seconds=DATA_TIMEOUT_S)
        store = dist.PrefixStore("data/", self._store)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = timeout
            self.data = dist.ProcessGroupNCCL(store, self.rank, self.size, opts)
        else:
            self.data = dist.ProcessGroupGloo(store, self.rank, self.size, timeout)
        self.device = device

    # ---- tensors (inside the model) -----------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place. With ``fixed_order_sums`` every element is
        summed rank 0 + 1 + 2 ... in that order: a ring all-reduce starts each element's sum
        at a rank that depends on where the element falls in the buffer, so (from three
        ranks on) on the number of tokens in the step."""
        if not self.fixed_order_sums:
            self.data.allreduce([x]).wait()
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.data.allgather([parts], [x.contiguous()]).wait()
        x.copy_(parts[0])
        for part in parts[1:]:
            x.add_(part)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along ``dim`` on the driver; None elsewhere."""
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.data.gather([parts], [x], opts).wait()
            return torch.cat(parts, dim=dim)
        self.data.gather([], [x], opts).wait()
        return None

    # ---- bytes (the driver's messages), authenticated --------------------------------
    def broadcast_bytes(self, data: bytes | None = None) -> bytes:
        """Send ``data`` from the driver to every rank; returns it on every rank."""
        if self.rank == 0:
            frame = self._auth.seal(data)
            self.ctrl.broadcast(torch.tensor([len(frame)], dtype=torch.long), 0).wait()
            self.ctrl.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8), 0).wait()
            return data
        size = torch.empty(1, dtype=torch.long)
        self.ctrl.broadcast(size, 0).wait()
        buf = torch.empty(self._frame_size(0, size), dtype=torch.uint8)
        self.ctrl.broadcast(buf, 0).wait()
        return self._auth.open(0, buf.numpy().tobytes())

    def post_broadcast_bytes(self, data: bytes) -> Callable[[], None]:
        """The driver's ``broadcast_bytes`` without waiting for the ranks to take it (a
        pipeline stage still busy with an earlier step takes it when it is done); returns
        what waits until every rank has."""
        frame = self._auth.seal(data)
        works = [self.ctrl.broadcast(torch.tensor([len(frame)], dtype=torch.long), 0),
                 self.ctrl.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8), 0)]

        def delivered() -> None:
            for work in works:
                work.wait()
        return delivered

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's ``data``, in rank order, on the driver; None elsewhere."""
        frame = self._auth.seal(data) if self.rank != 0 else b""  # the driver keeps its own
        size = torch.tensor([len(frame)], dtype=torch.long)
        sizes = [torch.empty(1, dtype=torch.long) for _ in range(self.size)]
        self.ctrl.allgather([sizes], [size]).wait()
        width = max(self._frame_size(r, s) for r, s in enumerate(sizes))
        buf = torch.zeros(width, dtype=torch.uint8)
        if frame:
            buf[: len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self.ctrl.gather([], [buf], opts).wait()
            return None
        bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        self.ctrl.gather([bufs], [buf], opts).wait()
        return [data] + [self._auth.open(r, bufs[r][: int(sizes[r].item())].numpy().tobytes())
                         for r in range(1, self.size)]

    def _frame_size(self, sender: int, size: torch.Tensor) -> int:
        n = int(size.item())
        if not 0 <= n <= MAX_FRAME_BYTES:
            raise ControlAuthError(f"control message from rank {sender} claims {n} bytes")
        return n

    def _allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (the same length on every rank), in rank order."""
        parts = [torch.empty(len(data), dtype=torch.uint8) for _ in range(self.size)]
        self.ctrl.allgather([parts], [torch.frombuffer(bytearray(data), dtype=torch.uint8)]).wait()
        return [p.numpy().tobytes() for p in parts]

    def abort(self) -> None:
        """Break pending NCCL collectives (a peer is gone); gloo notices by itself."""
        abort = getattr(self.data, "abort", None)
        if abort is not None and self.device.type == "cuda":
            try:
                abort()
            except Exception:  # best effort on a group that is already broken
                pass


def check_divisible(arch: ModelArch, size: int, expert_parallel: bool = False) -> None:
    """Each rank holds an equal share of the heads and of every MLP's (and, unless experts are
    placed whole, every expert's) width; placed experts need as many experts as ranks."""
    if size < 1:
        raise ValueError("tensor_parallel_size must be positive")
    widths = [("attention heads", arch.num_heads), ("KV heads", arch.num_kv_heads)]
    moe = arch.num_layers > len(arch.dense_layers) and arch.num_experts
    if moe and expert_parallel and arch.num_experts < size:
        raise ValueError(f"expert parallelism over {size} ranks needs at least as many experts "
                         f"(the model has {arch.num_experts})")
    if moe and not expert_parallel:
        widths.append(("experts' intermediate size", arch.expert_intermediate_size))
    if arch.num_experts == 0 or arch.dense_layers:
        widths.append(("MLP intermediate size", arch.intermediate_size))
    bad = [f"{what} ({n})" for what, n in widths if n % size]
    if bad:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's "
                         f"{', '.join(bad)}; each rank holds an equal share of the heads")
