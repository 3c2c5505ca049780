"""A torch-free stand-in for the model runner, for scheduler tests.

It mirrors the runner's bookkeeping from the scheduler's step descriptions
(new requests in full, running ones as changes) and keeps a fake paged KV cache:
computing the token at position p writes it into its slot and reads back every
earlier position through the block table. A wrong block table, a slot that was
never written or one overwritten by another request shows up as a wrong token
or an assertion. With prefix caching a request reads slots another request wrote;
they must hold exactly its own tokens. The "model" is a hash of the tokens read, so outputs depend
only on the sequence, never on batching.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from travelator.config import SchedulerConfig
from travelator.engine.block_manager import KVCacheManager
from travelator.engine.request import Request, RequestStatus, Stop
from travelator.engine.scheduler import SchedulerBase
from travelator.engine.scheduler_factory import make_scheduler as make_configured_scheduler
from travelator.engine.scheduler_output import RunnerOutput, SampledToken, SchedulerOutput
from travelator.sampling_params import SamplingParams

VOCAB = 1000


@dataclass
class _State:
    tokens: list[int]
    blocks: list[int]
    computed: int


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.states: dict[str, _State] = {}
        self.cache: dict[int, tuple[int, int]] = {}  # slot -> (position, token)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for rid in out.freed_request_ids:
            self.states.pop(rid, None)
        for new in out.new_requests:
            self.states[new.request_id] = _State(
                new.prompt_token_ids + new.output_token_ids, list(new.block_ids),
                new.num_computed_tokens)
        for c in out.cached_requests:
            s = self.states[c.request_id]
            s.blocks.extend(c.new_block_ids)
            assert s.computed == c.num_computed_tokens
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            s = self.states[rid]
            for pos in range(s.computed, s.computed + n):
                self.cache[self._slot(s, pos)] = (pos, s.tokens[pos])
            end = s.computed + n
            assert end <= len(s.tokens)
            seen = []
            for pos in range(end):
                p, tok = self.cache[self._slot(s, pos)]
                assert p == pos, "read a slot written for another position"
                seen.append(tok)
            assert seen == s.tokens[:end], "cache content differs from the sequence"
            s.computed = end
            if end == len(s.tokens):
                tok = zlib.crc32(repr(seen).encode()) % VOCAB
                s.tokens.append(tok)
                sampled[rid] = [SampledToken(tok)]
        return RunnerOutput(sampled)

    def _slot(self, s: _State, pos: int) -> int:
        return s.blocks[pos // self.bs] * self.bs + pos % self.bs


@dataclass
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    priority: int = 0


@dataclass
class SimResult:
    outputs: dict[str, list[int]]
    first_scheduled: dict[str, int]
    finished: dict[str, int]
    steps: int
    preemptions: int
    max_tokens_in_step: int
    max_seqs_in_step: int
    preempted: list[str] = field(default_factory=list)  # victims in order
    partial_chunks: int = 0  # scheduled pieces that stopped short of a request's known tokens


class StepClock:
    """The scheduler's clock in a simulation: the step number, so a queue delay of
    ``d`` ms is ``d / 1000`` steps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(batching: str, num_blocks: int, block_size: int, max_num_seqs: int,
                   budget: int, prefix_caching: bool = False,
                   scheduling_policy: str = "fcfs", queue_delay_steps: float = 0.0) -> SchedulerBase:
    return make_configured_scheduler(
        SchedulerConfig(batching=batching, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        scheduling_policy=scheduling_policy, max_queue_delay_ms=queue_delay_steps * 1000),
        KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching), StepClock())


def stop_by_length(sched: SchedulerBase, req: Request, toks: list[SampledToken]) -> None:
    """The engine's stop decision (``OutputProcessor.find_stop``) for requests that stop only
    at their length, as every simulated one does: tell the scheduler once."""
    if len(req.output_token_ids) >= req.max_tokens:
        kept = req.max_tokens - (len(req.output_token_ids) - len(toks))
        sched.stop_request(req, len(toks) - max(kept, 0), Stop(RequestStatus.FINISHED_LENGTH))


def simulate(sched: SchedulerBase, arrivals: list[Arrival], max_steps: int = 100_000) -> SimResult:
    runner = FakeRunner(sched.kv.block_size)
    pending = sorted(arrivals, key=lambda a: a.step)
    res = SimResult({}, {}, {}, 0, 0, 0, 0)
    preempt = sched._preempt

    def checked_preempt(victim: Request) -> None:
        # The no-thrash rule: a request that was preempted and readmitted is not
        # preempted again before it has produced a token.
        assert not victim.resumed_without_progress, f"{victim.request_id} preempted again before progress"
        res.preempted.append(victim.request_id)
        preempt(victim)

    sched._preempt = checked_preempt
    step = 0
    while pending or sched.has_unfinished():
        if isinstance(sched.clock, StepClock):
            sched.clock.now = float(step)
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            sched.add_request(Request(a.request_id, a.prompt, SamplingParams(ignore_eos=True,
                                      max_tokens=a.max_tokens), a.max_tokens, priority=a.priority))
        out = sched.schedule()
        res.max_tokens_in_step = max(res.max_tokens_in_step, out.total_num_scheduled_tokens)
        res.max_seqs_in_step = max(res.max_seqs_in_step, len(out.num_scheduled_tokens))
        for rid, n in out.num_scheduled_tokens.items():
            res.first_scheduled.setdefault(rid, step)
            req = sched.requests[rid]
            res.partial_chunks += req.num_computed_tokens + n < req.num_tokens
        for req, toks in sched.update_from_output(out, runner.execute(out)):
            stop_by_length(sched, req, toks)
            if req.status.finished:
                res.outputs[req.request_id] = list(req.output_token_ids)
                res.finished[req.request_id] = step
        sched.kv.check_consistency()
        step += 1
        assert step < max_steps, "the simulation did not finish: a hang or a starved request"
    res.steps = step
    res.preemptions = sched.num_preemptions
    return res
