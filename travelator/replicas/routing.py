"""Which replica serves a request, and why.

A prompt's text is cut into blocks of ``block_chars`` characters and each leading run of
blocks is keyed by a chained hash (block i's key covers blocks 0..i), as an engine keys its
KV blocks for the prefix cache. The router remembers which replica each key was last sent to.
A request goes to the replica that was sent its longest remembered prefix, unless that
replica has more than ``overload_margin`` requests in flight beyond the least loaded one;
then, and when no prefix is known, to the least loaded live replica (ties: lowest index).
A follow-up to a stored response goes to the replica that stored it, whatever its load: no
other replica could answer it.

The memory is bounded (least recently used keys forgotten first) and a replica's keys are
forgotten when it dies: its restarted engine has an empty cache. Thread-safe: the front end
routes on its event loop while the supervisor's threads mark replicas dead and alive.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

REASONS = ("prefix", "least_loaded", "prefix_overloaded", "previous_response")


class NoReplicaAlive(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: int
    reason: str  # one of REASONS
    matched_chars: int  # the leading characters already sent to ``replica`` (0 if none)


def prefix_keys(text: str, block_chars: int, max_blocks: int) -> list[int]:
    """The chained keys of ``text``'s leading full blocks."""
    keys, key = [], 0
    for start in range(0, min(len(text) // block_chars, max_blocks) * block_chars, block_chars):
        key = hash((key, text[start:start + block_chars]))
        keys.append(key)
    return keys


class PrefixRouter:
    def __init__(self, replicas: int, *, block_chars: int = 64, max_blocks: int = 256,
                 overload_margin: int = 4, max_keys: int = 1 << 16) -> None:
        self.block_chars, self.max_blocks = block_chars, max_blocks
        self.overload_margin, self.max_keys = overload_margin, max_keys
        self.in_flight = [0] * replicas
        self.alive = [True] * replicas
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica
        self._lock = threading.Lock()

    def choose(self, text: str, home: int | None = None) -> RouteDecision:
        """The replica for a prompt, counted in flight there until ``done``: ``home`` (the
        replica holding the response it follows) when that one is up; NoReplicaAlive when
        every replica is down."""
        keys = prefix_keys(text, self.block_chars, self.max_blocks)
        with self._lock:
            live = [i for i, up in enumerate(self.alive) if up]
            if not live:
                raise NoReplicaAlive("no replica is running")
            least = min(live, key=lambda i: (self.in_flight[i], i))
            owner, depth = self._longest_owner(keys)
            if home is not None and self.alive[home]:
                decision = RouteDecision(home, "previous_response", 0)
            elif owner is None:
                decision = RouteDecision(least, "least_loaded", 0)
            elif self.in_flight[owner] > self.in_flight[least] + self.overload_margin:
                decision = RouteDecision(least, "prefix_overloaded", 0)
            else:
                decision = RouteDecision(owner, "prefix", depth * self.block_chars)
            self._remember(keys, decision.replica)
            self.in_flight[decision.replica] += 1
        return decision

    def done(self, replica: int) -> None:
        with self._lock:
            self.in_flight[replica] -= 1

    def set_alive(self, replica: int, alive: bool) -> None:
        with self._lock:
            self.alive[replica] = alive
            if not alive:
                self._owner = OrderedDict((k, r) for k, r in self._owner.items() if r != replica)

    def _longest_owner(self, keys: list[int]) -> tuple[int | None, int]:
        owner, depth = None, 0
        for i, key in enumerate(keys):
            replica = self._owner.get(key)
            if replica is None:
                break
            if self.alive[replica]:
                owner, depth = replica, i + 1
        return owner, depth

    def _remember(self, keys: list[int], replica: int) -> None:
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)
