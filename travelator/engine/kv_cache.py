"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and per-request
block tables. Plain Python (the tensors themselves live in the model runner).

Blocks are handed out only as tokens are about to be computed, never reserved up to
a request's maximum length.
"""

from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def owners(self) -> dict[str, int]:
        """Blocks held per request, for leak reports."""
        return {rid: len(t) for rid, t in self._tables.items() if t}

    def allocate_slots(self, request_id: str, num_tokens_after: int) -> list[int] | None:
        """Make room for the request to hold ``num_tokens_after`` tokens in total.

        Returns the newly added block ids (possibly none), or None, changing nothing,
        when the pool has too few free blocks.
        """
        table = self._tables.setdefault(request_id, [])
        need = blocks_for(num_tokens_after, self.block_size) - len(table)
        if need <= 0:
            return []
        if need > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(need)]
        table.extend(new)
        return new

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            # Most recently used blocks go to the back, so blocks are reused in FIFO order.
            self._free.extend(reversed(table))

    def check_consistency(self) -> None:
        """Every block is either free or owned by exactly one request."""
        owned = [b for t in self._tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self._free), "a block is both free and owned"
        assert len(owned) + len(self._free) == self.num_blocks, "blocks leaked"
