"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-request block
tables and the prefix cache. Plain Python (the tensors live in the model runner).

Blocks are handed out only as tokens are about to be computed, never reserved up to
a request's maximum length.

Prefix caching: a block full of computed tokens is keyed by a hash chained over
every token before it (and a namespace plus the request's cache salt, since those
change the KV too). A new request reuses each leading full block whose key is still
in memory. Freed blocks keep their key and stay reusable until they are needed for
new data; they are evicted least-recently-freed first, the tail of a sequence
before its head. A reused block loses its old key (docs/design.md invariant 7).

Sliding windows: when every layer of the model attends to at most ``sliding_window`` keys
(Mistral), a request's blocks that fall wholly before the window of its next token are
never read again; ``release_out_of_window`` returns them to the pool as the request
advances, leaving ``RELEASED`` in its block table, which stays indexed by position
(docs/design.md, "Sliding windows and the block pool").

A ``KVCacheListener`` (optional) hears of every change to the set of keyed blocks: a block
keyed, a keyed block evicted, the cache cleared; engine/kv_events.py turns that into the
events cluster routers read.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Protocol

from travelator.engine.free_blocks import FreeBlocks
from travelator.engine.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# A block-table entry whose block went back to the pool: it lay wholly before the sliding
# window of every query the request has left to compute.
RELEASED = -1


class BlockAccountingError(RuntimeError):
    """The pool's bookkeeping is broken: a block is lost, in two places, or miscounted."""


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found in the cache


class KVCacheListener(Protocol):
    """What becomes of the prefix cache's keyed blocks, as it happens."""

    def blocks_stored(self, keys: list[bytes], parent: bytes | None, token_ids: list[int]) -> None:
        """Consecutive blocks of one sequence got keys; ``parent`` keys the block before the
        first (None: they start the sequence); ``token_ids`` are their tokens, in order."""

    def block_removed(self, key: bytes) -> None:
        """The block keyed ``key`` is reused for new data: the key is no longer cached."""

    def all_cleared(self) -> None:
        """Every key was dropped."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 namespace: str = "", sliding_window: int | None = None,
                 listener: KVCacheListener | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError("sliding_window must be positive (None: some layer sees the whole context)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # The window of every layer, where the model's every layer slides and nothing else
        # reads the blocks (None: blocks are held until the request ends).
        self.sliding_window = sliding_window
        self._root = hashlib.sha256(namespace.encode()).digest()
        self._ref_cnt = [0] * num_blocks
        self._block_key: list[bytes | None] = [None] * num_blocks
        # Free blocks in eviction order (front first); cached ones keep their key here.
        self._free = FreeBlocks(num_blocks)
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        # Blocks some request holds, counted as references come and go (not derived from the
        # free list), so that "free + used = total" is a check that can fail.
        self._num_used = 0
        self._num_keyed: dict[str, int] = {}  # leading blocks of a request already keyed
        self._num_released: dict[str, int] = {}  # leading blocks of a request back in the pool
        self.stats = PrefixCacheStats()
        self.listener = listener

    # ---- state ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def count_cached_free_blocks(self) -> int:
        """Free blocks that still hold a prefix-cache entry (O(cached blocks): for views, not steps)."""
        ref = self._ref_cnt
        return sum(1 for b in self._cached.values() if ref[b] == 0)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table, indexed by position // block_size (RELEASED entries
        lead it where a sliding window left blocks behind)."""
        return self._tables.get(request_id, [])

    def held_block_ids(self, request_id: str) -> list[int]:
        """The blocks the request holds: its table without the RELEASED entries."""
        table = self._tables.get(request_id, [])
        return table[self._num_released.get(request_id, 0):]

    def owners(self) -> dict[str, int]:
        """Blocks held per request, for leak reports."""
        return {rid: n for rid in self._tables if (n := len(self.held_block_ids(rid)))}

    # ---- prefix cache --------------------------------------------------------------
    def block_keys(self, req: Request) -> list[bytes]:
        """Keys of the request's full blocks, extended as its tokens grow."""
        keys = req.block_keys
        full = req.num_tokens // self.block_size
        if len(keys) < full:
            bs = self.block_size
            parent = keys[-1] if keys else self._salted_root(req.cache_salt)
            for i in range(len(keys), full):
                data = array("q", req.token_slice(i * bs, (i + 1) * bs)).tobytes()
                parent = hashlib.sha256(parent + data).digest()
                keys.append(parent)
        return keys

    def _salted_root(self, salt: str | None) -> bytes:
        return self._root if salt is None else hashlib.sha256(self._root + salt.encode()).digest()

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Leading blocks of a request that holds none yet, already in the cache.

        At least one token is always left to compute (docs/design.md invariant 6), so the last
        token's logits can be sampled. A request that reads every prompt row (its logprobs, a
        mean embedding) gets no hit: a cached block has keys and values, not logits or hidden states.
        """
        if not self.enable_prefix_caching or req.sampling_params.needs_every_prompt_row:
            return []
        hits: list[int] = []
        for key in self.block_keys(req):
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= req.num_tokens:
            hits.pop()
        return hits

    def cache_full_blocks(self, req: Request) -> None:
        """Key the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        table = self._tables.get(rid, [])
        full = min(req.num_computed_tokens // self.block_size, len(table))
        # Released blocks were keyed before their release (or never will be).
        start = max(self._num_keyed.get(rid, 0), self._num_released.get(rid, 0))
        if full <= start:
            return
        keys = self.block_keys(req)
        stored: list[int] = []
        for i in range(start, full):
            block, key = table[i], keys[i]
            if self._block_key[block] is None and key not in self._cached:
                self._cached[key] = block
                self._block_key[block] = key
                stored.append(i)
            # else: it is a cache hit already, or a twin block holds the key.
        self._num_keyed[rid] = full
        if stored and self.listener is not None:
            self._announce_stored(req, keys, stored)

    def _announce_stored(self, req: Request, keys: list[bytes], positions: list[int]) -> None:
        """Tell the listener of the newly keyed blocks at ``positions``, one call per run of
        consecutive ones (a twin elsewhere, already keyed, splits a run)."""
        bs = self.block_size
        run_start = 0
        for j in range(1, len(positions) + 1):
            if j == len(positions) or positions[j] != positions[j - 1] + 1:
                first, last = positions[run_start], positions[j - 1]
                self.listener.blocks_stored(keys[first:last + 1], keys[first - 1] if first else None,
                                            req.token_slice(first * bs, (last + 1) * bs))
                run_start = j

    # ---- allocation ----------------------------------------------------------------
    def allocate_slots(self, req: Request, num_tokens_after: int,
                       cached_blocks: list[int] = ()) -> list[int] | None:
        """Make room for the request to hold ``num_tokens_after`` tokens in total,
        first taking ``cached_blocks`` (a prefix hit) into its table.

        Returns the newly added block ids (possibly none), or None, changing
        nothing, when the pool has too few free blocks.
        """
        rid = req.request_id
        table = self._tables.get(rid, [])
        need = blocks_for(num_tokens_after, self.block_size) - len(table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self._ref_cnt[b] == 0)
        if max(need, 0) + revived > len(self._free):
            return None
        table = self._tables.setdefault(rid, table)
        for b in cached_blocks:
            if self._ref_cnt[b] == 0:
                self._free.remove(b)
                self._num_used += 1
            self._ref_cnt[b] += 1
            table.append(b)
        if cached_blocks:
            self._num_keyed[rid] = len(table)
        new = [self._take_free_block() for _ in range(max(need, 0))]
        table.extend(new)
        return list(cached_blocks) + new

    def _take_free_block(self) -> int:
        block = self._free.pop_first()
        key = self._block_key[block]
        if key is not None:  # evict: the block is about to hold new data
            if self._cached.get(key) == block:
                del self._cached[key]
                if self.listener is not None:
                    self.listener.block_removed(key)
            self._block_key[block] = None
        self._ref_cnt[block] = 1
        self._num_used += 1
        return block

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        self._num_keyed.pop(request_id, None)
        released = self._num_released.pop(request_id, 0)
        if not table:
            return
        # The tail goes in first, so it is evicted before the (more shareable) head.
        for block in reversed(table[released:]):
            self._unref(block)

    def release_out_of_window(self, req: Request) -> None:
        """Return the request's blocks that none of its queries reads again (a model whose
        every layer slides: ``sliding_window``). Its next token, at position
        num_computed_tokens = c, and every later one see keys from c - window + 1 on, so the
        blocks wholly before that key's block go back to the pool; their table entries become
        RELEASED. Call it once the step's tokens are counted in c (and keyed for the prefix
        cache: a keyed block keeps its key while free, as any freed block, and stays a
        possible hit, its contents being final). Not for a request whose KV is to be handed
        off: the hand-off reads every block."""
        if self.sliding_window is None or req.hand_off:
            return
        rid = req.request_id
        table = self._tables.get(rid)
        if not table:
            return
        first_seen = max(0, req.num_computed_tokens - self.sliding_window + 1)
        end = min(first_seen // self.block_size, len(table))
        start = self._num_released.get(rid, 0)
        if end <= start:
            return
        for i in range(start, end):
            self._unref(table[i])
            table[i] = RELEASED
        self._num_released[rid] = end

    def _unref(self, block: int) -> None:
        """Drop one reference; a block nobody holds goes to the free list."""
        self._ref_cnt[block] -= 1
        if self._ref_cnt[block] == 0:
            self._num_used -= 1
            if self._block_key[block] is None:
                # Nothing reusable in it: hand it out before any cached block.
                self._free.push_front(block)
            else:
                self._free.push_back(block)

    def reset_prefix_cache(self) -> bool:
        """Drop every key (after a weight reload, say), when no request holds a block: a held
        block may be read by its request's later steps as a hit. Returns whether it did."""
        if self._num_used:
            return False
        self._cached.clear()
        self._block_key = [None] * self.num_blocks
        if self.listener is not None:
            self.listener.all_cleared()
        return True

    def cached_keys(self) -> set[bytes]:
        """The keys the prefix cache holds now (O(cached blocks): for checks, not steps)."""
        return set(self._cached)

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queried_tokens += num_prompt_tokens
        self.stats.hit_tokens += num_hit_tokens

    def check_consistency(self) -> None:
        """Every block is in exactly one place (some block table, or the free list), the
        used-block count agrees with the tables, and every reference is accounted for.

        Raises BlockAccountingError (a real exception: it holds under ``python -O``).
        """
        counts = [0] * self.num_blocks
        for rid, table in self._tables.items():
            released = self._num_released.get(rid, 0)
            held = table[released:]
            if any(b != RELEASED for b in table[:released]) or RELEASED in held:
                raise BlockAccountingError(f"request {rid!r}'s released entries are not the first "
                                           f"{released} of its table: {table}")
            if len(set(held)) != len(held):
                raise BlockAccountingError(f"request {rid!r} holds a block twice: {table}")
            for b in held:
                counts[b] += 1
        if counts != self._ref_cnt:
            wrong = [b for b in range(self.num_blocks) if counts[b] != self._ref_cnt[b]]
            raise BlockAccountingError(f"reference counts disagree with the block tables for "
                                       f"blocks {wrong[:10]}")
        used = {b for b in range(self.num_blocks) if counts[b]}
        free = set(self._free)
        if used & free:
            raise BlockAccountingError(f"blocks both free and in a block table: {sorted(used & free)[:10]}")
        lost = set(range(self.num_blocks)) - used - free
        if lost:
            raise BlockAccountingError(f"blocks in no block table and not free: {sorted(lost)[:10]}")
        if self._num_used != len(used):
            raise BlockAccountingError(f"{self._num_used} blocks counted as used, but the block "
                                       f"tables hold {len(used)}")
        for key, b in self._cached.items():
            if self._block_key[b] != key:
                raise BlockAccountingError(f"the cache entry of block {b} has another key")
