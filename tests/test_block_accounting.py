"""The block pool's accounting can fail: a lost block, a block in two places, a miscount.

Each check is shown failing once on a deliberately broken pool; a healthy pool passes them all,
through allocation, prefix-cache hits and frees.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from travelator.engine.kv_cache import BlockAccountingError, KVCacheManager
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
    kv._free.popitem()  # a block vanishes: in no table, not free
    assert not balanced(kv)
    with pytest.raises(BlockAccountingError, match="in no block table and not free"):
        kv.check_consistency()


def test_a_block_in_two_places_is_found():
    kv, a = busy_pool()
    kv._free[kv.block_ids(a.request_id)[-1]] = None  # freed while still held
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
    code = ("from travelator.engine.kv_cache import KVCacheManager, BlockAccountingError\n"
            "kv = KVCacheManager(4, 4)\n"
            "kv._free.popitem()\n"
            "try:\n"
            "    kv.check_consistency()\n"
            "except BlockAccountingError:\n"
            "    print('caught')\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "caught"
