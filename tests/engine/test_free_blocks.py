"""The KV pool's free list: the same eviction order as a list made of every block up front,
without making one."""

from __future__ import annotations

import random
from collections import OrderedDict

from travelator.engine.free_blocks import FreeBlocks


def test_the_order_matches_a_materialized_free_list():
    # The reference: every block listed in id order from the start, as the pool used to be.
    n = 64
    reference: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))
    free = FreeBlocks(n)
    held: list[int] = []
    rng = random.Random(0)
    for _ in range(3000):
        op = rng.random()
        if held and op < 0.45:
            block = held.pop(rng.randrange(len(held)))
            reference[block] = None
            if rng.random() < 0.5:
                reference.move_to_end(block, last=False)
                free.push_front(block)
            else:
                free.push_back(block)
        elif held and op < 0.5 and len(reference) > 0:
            block = rng.choice(list(reference))  # a prefix hit revives a freed block
            if block in free._front or block in free._back:
                del reference[block]
                free.remove(block)
                held.append(block)
        elif reference:
            expected, _ = reference.popitem(last=False)
            assert free.pop_first() == expected
            held.append(expected)
        assert len(free) == len(reference)
        assert list(free) == list(reference)


def test_a_huge_pool_costs_nothing_to_create():
    free = FreeBlocks(10**15)  # a materialized list of this size could not exist
    assert len(free) == 10**15
    assert [free.pop_first() for _ in range(3)] == [0, 1, 2]
    free.push_front(1)
    assert free.pop_first() == 1 and free.pop_first() == 3
