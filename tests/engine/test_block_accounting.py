"""The block pool's accounting can fail: a lost block, a block in two places, a miscount.

Each check is shown failing once on a deliberately broken pool; a healthy pool passes them all,
through allocation, prefix-cache hits and frees.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from travelator.engine.block_manager import RELEASED, BlockAccountingError, KVCacheManager
from travelator.engine.request import Request
from travelator.sampling_params import SamplingParams


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), 4)


def balanced(kv: KVCacheManager) -> bool:
    return kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks


def busy_pool() -> tuple[KVCacheManager, Request]:
    """A pool with two requests sharing a cached prefix and one freed, keyed request."""
    kv = KVCacheManager(16, 4)
    a = request("a", list(range(1, 14)))
    kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    b = request("b", list(range(1, 14)))
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 3
    kv.allocate_slots(b, b.num_tokens, hits)
    gone = request("gone", [50] * 9)
    kv.allocate_slots(gone, 9)
    gone.num_computed_tokens = 9
    kv.cache_full_blocks(gone)
    kv.free("gone")
    return kv, a


def test_a_healthy_pool_passes():
    kv, _ = busy_pool()
    kv.check_consistency()
    assert balanced(kv)
    assert kv.num_used_blocks == 5  # a's 4 blocks, 3 of them shared with b, plus b's last one
    kv.free("a")
    kv.free("b")
    kv.check_consistency()
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 16


def test_a_lost_block_is_found():
    kv, _ = busy_pool()
    kv._free.pop_first()  # a block vanishes: in no table, not free
    assert not balanced(kv)
    with pytest.raises(BlockAccountingError, match="in no block table and not free"):
        kv.check_consistency()


def test_a_block_in_two_places_is_found():
    kv, a = busy_pool()
    kv._free.push_back(kv.block_ids(a.request_id)[-1])  # freed while still held
    assert not balanced(kv)
    with pytest.raises(BlockAccountingError, match="both free and in a block table"):
        kv.check_consistency()


def test_a_miscounted_pool_is_found():
    kv, _ = busy_pool()
    kv._num_used += 1
    assert not balanced(kv)
    with pytest.raises(BlockAccountingError, match="counted as used"):
        kv.check_consistency()


def test_a_wrong_reference_count_is_found():
    kv, a = busy_pool()
    kv._ref_cnt[kv.block_ids(a.request_id)[0]] += 1
    with pytest.raises(BlockAccountingError, match="reference counts disagree"):
        kv.check_consistency()


def test_the_check_holds_under_python_O():
    code = ("from travelator.engine.block_manager import KVCacheManager, BlockAccountingError\n"
            "kv = KVCacheManager(4, 4)\n"
            "kv._free.pop_first()\n"
            "try:\n"
            "    kv.check_consistency()\n"
            "except BlockAccountingError:\n"
            "    print('caught')\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "caught"


# ---- sliding windows: blocks behind every window go back to the pool -----------------------

def advance(kv: KVCacheManager, r: Request, n: int) -> None:
    """Allocate and compute the request's next n tokens, as a step and its update do."""
    assert kv.allocate_slots(r, r.num_computed_tokens + n) is not None
    r.num_computed_tokens += n
    kv.cache_full_blocks(r)
    kv.release_out_of_window(r)


def test_blocks_before_the_window_go_back_to_the_pool():
    """Window 6, blocks of 4: after computing c tokens, the next query (position c) sees keys
    c - 5 .. c, so blocks wholly before key c - 5 are released: the table keeps its length
    (indexed by position) with RELEASED in front, and the pool's books balance throughout."""
    kv = KVCacheManager(16, 4, sliding_window=6)
    r = Request("r", list(range(1, 41)), SamplingParams(max_tokens=4), 4)
    advance(kv, r, 9)  # keys 4.. seen by position 9: block 0 (keys 0-3) goes
    assert kv.block_ids("r")[:1] == [RELEASED] and len(kv.block_ids("r")) == 3
    assert len(kv.held_block_ids("r")) == 2 and kv.num_used_blocks == 2
    kv.check_consistency()
    advance(kv, r, 1)  # position 10 sees keys 5..10: block 1 (keys 4-7) stays
    assert kv.block_ids("r").count(RELEASED) == 1
    advance(kv, r, 1)  # position 11 sees keys 6..11: still block 1
    advance(kv, r, 1)  # position 12 sees keys 7..12: still block 1
    assert kv.block_ids("r").count(RELEASED) == 1
    advance(kv, r, 1)  # position 13 sees keys 8..13: block 1 goes
    assert kv.block_ids("r")[:2] == [RELEASED, RELEASED]
    for _ in range(20):  # decodes hold at most ceil((window - 1) / block_size) + 1 blocks
        advance(kv, r, 1)
        assert len(kv.held_block_ids("r")) <= 3
        kv.check_consistency()
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
    assert len(kv.block_ids("r")) == 9 and kv.owners() == {"r": len(kv.held_block_ids("r"))}
    kv.free("r")
    kv.check_consistency()
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 16


def test_released_blocks_stay_prefix_hits_until_evicted():
    """A released block was keyed first (it is full of final keys and values): free, it stays
    a hit for a request with the same prefix, which takes it back from the pool."""
    kv = KVCacheManager(16, 4, sliding_window=5)
    prompt = list(range(1, 22))
    a = Request("a", prompt, SamplingParams(max_tokens=4), 4)
    advance(kv, a, 21)  # blocks 0-3 before key 16 go back, keyed
    released = [b for b in range(16) if kv._ref_cnt[b] == 0 and kv._block_key[b] is not None]
    assert len(released) == 4 and kv.num_cached_blocks == 5
    b = Request("b", prompt + [99], SamplingParams(max_tokens=4), 4)
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 5 and sorted(hits[:4]) == sorted(released)
    kv.allocate_slots(b, b.num_tokens, hits)
    kv.check_consistency()
    assert kv.num_used_blocks == 7  # a's blocks 4 and 5, b's hits 0-3 (4 is shared) and its last
    b.num_computed_tokens = 20  # the hit: the last block is computed again
    kv.release_out_of_window(b)  # position 20 sees keys 16..: b lets go of blocks 0-3 again
    assert kv.block_ids("b")[:4] == [RELEASED] * 4
    kv.check_consistency()
    assert kv.num_used_blocks == 3


def test_no_release_without_a_window_nor_for_a_hand_off():
    for window, hand_off in ((None, False), (6, True)):
        kv = KVCacheManager(16, 4, sliding_window=window)
        r = Request("r", list(range(1, 41)), SamplingParams(max_tokens=4), 4)
        r.hand_off = hand_off
        advance(kv, r, 30)
        assert RELEASED not in kv.block_ids("r") and len(kv.held_block_ids("r")) == 8


def test_a_released_entry_out_of_place_is_found():
    kv = KVCacheManager(16, 4, sliding_window=6)
    r = Request("r", list(range(1, 41)), SamplingParams(max_tokens=4), 4)
    advance(kv, r, 20)
    table = kv._tables["r"]
    table[0], table[-1] = table[-1], table[0]  # a released entry behind a held block
    with pytest.raises(BlockAccountingError, match="released entries"):
        kv.check_consistency()
