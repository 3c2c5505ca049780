"""The KV pool's free blocks in eviction order, cheap to create for any pool size.

A pool starts with every block free, in id order; materializing that list costs time in
proportion to the pool (seconds for the millions of blocks of a simulated large deployment).
Blocks never handed out are kept as a range instead: the order is the blocks put at the front,
then the untouched range, then the blocks put at the back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class FreeBlocks:
    def __init__(self, num_blocks: int) -> None:
        self._front: OrderedDict[int, None] = OrderedDict()  # first out is first in it
        self._next_untouched = 0
        self._num_blocks = num_blocks
        self._back: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._front) + (self._num_blocks - self._next_untouched) + len(self._back)

    def __iter__(self) -> Iterator[int]:
        yield from self._front
        yield from range(self._next_untouched, self._num_blocks)
        yield from self._back

    def pop_first(self) -> int:
        if self._front:
            return self._front.popitem(last=False)[0]
        if self._next_untouched < self._num_blocks:
            self._next_untouched += 1
            return self._next_untouched - 1
        return self._back.popitem(last=False)[0]

    def push_back(self, block: int) -> None:
        """``block`` goes out after every block now free."""
        self._back[block] = None

    def push_front(self, block: int) -> None:
        """``block`` goes out before every block now free."""
        self._front[block] = None
        self._front.move_to_end(block, last=False)

    def remove(self, block: int) -> None:
        """Take out ``block``, once handed out and freed since (a prefix-cache hit revives it)."""
        if block in self._front:
            del self._front[block]
        else:
            del self._back[block]
