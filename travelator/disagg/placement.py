"""Which prefill worker computes a request's prompt, and which decode worker continues it.

Decode workers report their KV pool (free blocks) and running count after every step. A
request sent towards a decode worker is a *promise* on that worker (the blocks its prompt and
first token will take) until the worker reports it running: until then the worker's own
report does not count it. A request goes to the decode worker with the most free blocks left
after promises (ties: fewest running and promised requests, then the lowest index); when none
has room for it, ``choose_decode`` returns None and the front end holds the request back
(backpressure: the request waits before its prefill, nothing is dropped).

Prefill workers are chosen by the fewest prompt tokens sent and not yet answered. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class DecodeLoad:
    free_blocks: int
    running: int = 0
    alive: bool = True
    promised: dict[str, int] = field(default_factory=dict)  # request id -> blocks

    @property
    def room(self) -> int:
        return self.free_blocks - sum(self.promised.values())


@dataclass(slots=True)
class PrefillLoad:
    alive: bool = True
    pending: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens

    @property
    def tokens(self) -> int:
        return sum(self.pending.values())


class Placement:
    def __init__(self, num_prefill: int, decode_free_blocks: list[int]) -> None:
        self.prefill = [PrefillLoad() for _ in range(num_prefill)]
        self.decode = [DecodeLoad(free) for free in decode_free_blocks]

    # ---- prefill ------------------------------------------------------------------------
    def choose_prefill(self) -> int | None:
        alive = [i for i, w in enumerate(self.prefill) if w.alive]
        return min(alive, key=lambda i: (self.prefill[i].tokens, i)) if alive else None

    def prefill_sent(self, worker: int, request_id: str, prompt_tokens: int) -> None:
        self.prefill[worker].pending[request_id] = prompt_tokens

    def prefill_done(self, worker: int, request_id: str) -> None:
        self.prefill[worker].pending.pop(request_id, None)

    # ---- decode -------------------------------------------------------------------------
    def choose_decode(self, blocks: int) -> int | None:
        """The decode worker to promise ``blocks`` to, or None when none has room now."""
        fits = [i for i, w in enumerate(self.decode) if w.alive and w.room >= blocks]
        if not fits:
            return None
        return min(fits, key=lambda i: (-self.decode[i].room,
                                        self.decode[i].running + len(self.decode[i].promised), i))

    def promise(self, worker: int, request_id: str, blocks: int) -> None:
        self.decode[worker].promised[request_id] = blocks

    def release(self, worker: int, request_id: str) -> None:
        """The worker runs the request now (its report counts it), or never will."""
        self.decode[worker].promised.pop(request_id, None)

    def report(self, worker: int, free_blocks: int, running: int) -> None:
        load = self.decode[worker]
        load.free_blocks, load.running = free_blocks, running

    # ---- faults -------------------------------------------------------------------------
    def mark_dead(self, role: str, worker: int) -> None:
        loads = self.prefill if role == "prefill" else self.decode
        loads[worker].alive = False

    def alive(self, role: str) -> int:
        return sum(w.alive for w in (self.prefill if role == "prefill" else self.decode))
