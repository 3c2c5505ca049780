"""A worker process of a disaggregated server: one engine, in one role.

A **prefill worker** runs each request it is sent with ``hand_off``: it computes the prompt
(chunked, with prefix caching) and the first token, reports that token to the front end, reads
the request's KV out of its pool (the blocks are then freed; full ones stay in its prefix
cache) and gives it to a sender thread, one per decode worker, that sends it over their gloo
pair. A **decode worker** has one receiver thread per prefill worker; a request whose KV has
come and that the front end announced (``Expect``) joins its engine through ``add_handoff``,
first come first served, as soon as its pool has room.

Everything reaches the worker's loop through one inbox: the front end's commands (forwarded
from their multiprocessing queue), KV that arrived, transfers that failed. Only the loop
touches the engine. After each step it sends one ``Report`` (outputs and state); at rest,
one a second.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from travelator.config import EngineConfig
from travelator.disagg import messages as m
from travelator.disagg.kv_transport import KVChannel
from travelator.engine.engine import LLMEngine
from travelator.engine.kv_handoff import KVHandoff, KVPoolFullError
from travelator.engine.outputs import RequestOutput
from travelator.engine.self_check import engine_self_check
from travelator.engine.tp_worker import watch_parent

logger = logging.getLogger(__name__)

IDLE_REPORT_S = 1.0
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(slots=True)
class DisaggWorkerSpec:
    """What a worker process needs to start: its role and index, its engine's settings, and
    the front end's store (for the KV pairs)."""

    worker: m.WorkerId
    config: EngineConfig
    store_host: str
    store_port: int
    num_prefill: int
    num_decode: int
    threads: int
    parent_pid: int
    connect_timeout_s: float = 300.0
    # The address gloo binds for the KV pairs, one the other hosts reach (None: gloo's choice,
    # on one machine).
    kv_host: str | None = None


# Inbox items from the worker's own threads.
@dataclass(slots=True)
class _Arrived:
    prefill: int
    handoff: KVHandoff


@dataclass(slots=True)
class _PeerLost:
    peer: int
    error: str


@dataclass(slots=True)
class _SendFailed:
    request_id: str
    decode: int  # the decode worker it could not be sent to
    error: str


def pair_channel(store: dist.Store, prefill: int, decode: int, role: str, timeout_s: float,
                 host: str | None = None) -> KVChannel:
    """The gloo pair of one prefill and one decode worker: rank 0 the prefill side. A pair
    per couple, so that a worker that dies breaks only its own pairs."""
    return KVChannel(dist.PrefixStore(f"pair/{prefill}-{decode}/", store), 0 if role == m.PREFILL else 1, 2,
                     timeout_s=timeout_s, host=host)


def run_worker(spec: DisaggWorkerSpec, commands, events: Connection) -> None:
    """The process's entry point (multiprocessing, spawn). ``events`` is this worker's own pipe
    to the front end: a worker killed in the middle of a message breaks only its own stream (a
    queue shared by all workers would stay locked by it, and every other worker's reports with it).
    On another host both are its connection to the front end (``hosts.FrontEndLink``)."""
    logging.basicConfig(level=os.environ.get("TRAVELATOR_LOG_LEVEL", "WARNING"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    threading.Thread(target=watch_parent, args=(spec.parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.threads)
    # Under torchrun this process inherits the launch environment, which describes the hosts
    # of the disaggregated server; its own engine is one rank (else it would wait for a group).
    for name in LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    try:
        engine = LLMEngine(spec.config)
        store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.connect_timeout_s))
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        if spec.worker.role == m.PREFILL:
            loop: _WorkerLoop = PrefillLoop(spec, engine, store, inbox, events)
        else:
            loop = DecodeLoop(spec, engine, store, inbox, events)
        threading.Thread(target=_forward, args=(commands, inbox), daemon=True,
                         name="travelator-commands").start()
        events.send(m.Ready(spec.worker, engine.max_model_len, engine.kv.num_blocks, engine.kv.block_size,
                           os.getpid()))
        loop.serve()
    except BaseException as exc:  # noqa: BLE001 - tell the front end, then exit non-zero
        logger.exception("%s failed", spec.worker)
        events.send(m.Died(spec.worker, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
        events.close()
        os._exit(1)
    # Not a normal exit: the transfer threads sit in gloo calls that must not be unwound.
    events.close()
    os._exit(0)


def _forward(commands, inbox: queue.SimpleQueue) -> None:
    while True:
        cmd = commands.get()
        inbox.put(cmd)
        if cmd == m.STOP:
            return


class _WorkerLoop:
    def __init__(self, spec: DisaggWorkerSpec, engine: LLMEngine, inbox: queue.SimpleQueue, events: Connection) -> None:
        self.worker = spec.worker
        self.engine = engine
        self.inbox = inbox
        self.events = events
        self.channels: list[KVChannel] = []
        self._outputs: list[RequestOutput] = []
        self._failed: dict[str, str] = {}

    def serve(self) -> None:
        last_report = time.monotonic()
        while True:
            busy = self.engine.has_unfinished_requests() or self.has_ready_work()
            for item in self._take_inbox(wait_s=0.0 if busy else IDLE_REPORT_S):
                if item == m.STOP:
                    return
                self.handle(item)
            self.before_step()
            steps = self.engine.counters.steps
            if self.engine.has_unfinished_requests():
                self._outputs += self.engine.step()
            stepped = self.engine.counters.steps != steps
            now = time.monotonic()
            if stepped or self._outputs or self._failed or self.has_news() or now - last_report >= IDLE_REPORT_S:
                report = self.report(self._outputs, self._failed)
                report.step = self.engine.last_step if stepped else None
                report.clock = time.monotonic()
                self.events.send(report)
                self.after_report()
                self._outputs, self._failed = [], {}
                last_report = now

    def _take_inbox(self, wait_s: float) -> list:
        items = []
        try:
            items.append(self.inbox.get(timeout=wait_s) if wait_s else self.inbox.get_nowait())
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def fail(self, request_id: str, why: str) -> None:
        self._failed[request_id] = why

    def emit(self, outputs: list[RequestOutput]) -> None:
        self._outputs += outputs

    def stats(self, pending: int = 0) -> m.WorkerStats:
        e = self.engine
        kv = e.kv
        # Kept by the sender/receiver threads: read without a lock, a figure may lag a hand-off.
        moved = [ch.sent if self.worker.role == m.PREFILL else ch.received for ch in self.channels]
        return m.WorkerStats(
            free_blocks=kv.num_free_blocks, used_blocks=kv.num_used_blocks, total_blocks=kv.num_blocks,
            cached_blocks=kv.num_cached_blocks, running=e.num_running, waiting=e.num_waiting,
            counters=dataclasses.asdict(e.counters), prefix_queried_tokens=kv.stats.queried_tokens,
            prefix_hit_tokens=kv.stats.hit_tokens, pending_handoffs=pending, transfers=sum(t.handoffs for t in moved),
            transfer_bytes=sum(t.bytes for t in moved), transfer_seconds=sum(t.seconds for t in moved))

    def check(self, token: int) -> None:
        report = engine_self_check(self.engine)
        report["worker"] = self.local_state()
        if any(report["worker"].values()):
            report["idle"] = False
        self.events.send(m.CheckReport(self.worker, token, report))

    # ---- what each role adds -----------------------------------------------------------
    def handle(self, item) -> None:
        raise NotImplementedError

    def before_step(self) -> None:
        pass

    def has_ready_work(self) -> bool:
        return False

    def has_news(self) -> bool:
        return False

    def after_report(self) -> None:
        pass

    def report(self, outputs: list[RequestOutput], failed: dict[str, str]) -> m.Report:
        raise NotImplementedError

    def local_state(self) -> dict[str, int]:
        """Counts of the worker's own per-request maps (all 0 at rest)."""
        raise NotImplementedError


class PrefillLoop(_WorkerLoop):
    def __init__(self, spec: DisaggWorkerSpec, engine: LLMEngine, store: dist.Store, inbox: queue.SimpleQueue,
                 events: Connection) -> None:
        super().__init__(spec, engine, inbox, events)
        self.targets: dict[str, int | None] = {}  # request id -> decode worker
        self.handed_off: list[str] = []
        self.to_send: list[tuple[int, KVHandoff]] = []
        self.lost_peers: set[int] = set()  # decode workers a send failed to, since the last report
        self.outboxes: list[queue.SimpleQueue] = []
        for d in range(spec.num_decode):
            channel = pair_channel(store, spec.worker.index, d, m.PREFILL, spec.connect_timeout_s, spec.kv_host)
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            self.channels.append(channel)
            self.outboxes.append(outbox)
            threading.Thread(target=self._send_loop, args=(d, channel, outbox), daemon=True,
                             name=f"travelator-kv-send-{d}").start()

    def handle(self, item) -> None:
        if isinstance(item, m.Submit):
            try:
                self.engine.add_request(item.prompt_token_ids, item.params, item.request_id, item.priority,
                                        item.cache_salt, hand_off=item.decode is not None)
                self.targets[item.request_id] = item.decode
            except ValueError as exc:
                self.fail(item.request_id, str(exc))
        elif isinstance(item, m.Abort):
            if item.request_id in self.engine.scheduler.requests:
                self.emit(self.engine.abort_request([item.request_id]))
        elif isinstance(item, _SendFailed):
            self.fail(item.request_id, item.error)
            self.lost_peers.add(item.decode)
        elif isinstance(item, m.Check):
            self.check(item.token)

    def report(self, outputs: list[RequestOutput], failed: dict[str, str]) -> m.Report:
        for out in outputs:
            if not out.finished:
                continue
            decode = self.targets.pop(out.request_id, None)
            if out.handoff is not None:
                handoff, out.handoff = out.handoff, None
                self.to_send.append((decode, handoff))
                self.handed_off.append(out.request_id)
        for rid in failed:
            self.targets.pop(rid, None)
        handed_off, self.handed_off = self.handed_off, []
        lost, self.lost_peers = sorted(self.lost_peers), set()
        return m.Report(self.worker, outputs, self.stats(), handed_off=handed_off, failed=failed,
                        lost_peers=lost)

    def after_report(self) -> None:
        # The KV goes after the report with the first token: the front end usually hears of
        # that token before the decode worker's next ones (it copes when it does not).
        for decode, handoff in self.to_send:
            self.outboxes[decode].put(handoff)
        self.to_send = []

    def local_state(self) -> dict[str, int]:
        return {"targets": len(self.targets)}

    def _send_loop(self, decode: int, channel: KVChannel, outbox: queue.SimpleQueue) -> None:
        broken: str | None = None
        while True:
            handoff: KVHandoff = outbox.get()
            if broken is None:
                try:
                    channel.send(handoff, 1)
                    continue
                except Exception as exc:  # noqa: BLE001 - the pair is gone: fail what goes to it
                    broken = f"the KV transfer to decode worker {decode} failed: {exc!r}"
                    logger.error("%s", broken)
            self.inbox.put(_SendFailed(handoff.request_id, decode, broken))


class DecodeLoop(_WorkerLoop):
    def __init__(self, spec: DisaggWorkerSpec, engine: LLMEngine, store: dist.Store, inbox: queue.SimpleQueue,
                 events: Connection) -> None:
        super().__init__(spec, engine, inbox, events)
        self.expected: dict[str, m.Expect] = {}
        self.aborted: set[str] = set()  # expected, then aborted: their KV is dropped when it comes
        self.orphans: dict[str, tuple[int, KVHandoff]] = {}  # KV that came before its Expect
        self.ready: deque[tuple[m.Expect, KVHandoff]] = deque()  # waiting for room in the pool
        self.admitted: list[str] = []
        for p in range(spec.num_prefill):
            channel = pair_channel(store, p, spec.worker.index, m.DECODE, spec.connect_timeout_s, spec.kv_host)
            self.channels.append(channel)
            threading.Thread(target=self._receive_loop, args=(p, channel), daemon=True,
                             name=f"travelator-kv-recv-{p}").start()

    def handle(self, item) -> None:
        if isinstance(item, _Arrived):
            self._arrived(item.prefill, item.handoff)
        elif isinstance(item, m.Expect):
            if (orphan := self.orphans.pop(item.request_id, None)) is not None:
                self.ready.append((item, orphan[1]))
            else:
                self.expected[item.request_id] = item
        elif isinstance(item, m.Abort):
            rid = item.request_id
            if rid in self.engine.scheduler.requests:
                self.emit(self.engine.abort_request([rid]))
            elif rid in self.expected:
                self.aborted.add(rid)
            self._drop_ready(rid)
            self.orphans.pop(rid, None)
        elif isinstance(item, m.Forget):
            if item.request_id in self.engine.scheduler.requests:  # failed elsewhere meanwhile
                self.emit(self.engine.abort_request([item.request_id]))
            self.expected.pop(item.request_id, None)
            self.aborted.discard(item.request_id)
            self.orphans.pop(item.request_id, None)
            self._drop_ready(item.request_id)
        elif isinstance(item, _PeerLost):
            # Nothing more comes from that prefill worker: fail what was expected from it (the
            # front end has closed them already when the worker died; else they would wait for ever).
            for rid in [r for r, e in self.expected.items() if e.prefill == item.peer]:
                del self.expected[rid]
                if rid not in self.aborted:
                    self.fail(rid, f"the KV link from prefill worker {item.peer} broke: {item.error}")
                self.aborted.discard(rid)
            for rid in [r for r, (p, _) in self.orphans.items() if p == item.peer]:
                del self.orphans[rid]
        elif isinstance(item, m.Check):
            self.check(item.token)

    def _arrived(self, prefill: int, handoff: KVHandoff) -> None:
        rid = handoff.request_id
        expect = self.expected.pop(rid, None)
        if expect is None:
            self.orphans[rid] = (prefill, handoff)
        elif rid in self.aborted:
            self.aborted.discard(rid)
        else:
            self.ready.append((expect, handoff))

    def _drop_ready(self, request_id: str) -> None:
        self.ready = deque((e, h) for e, h in self.ready if e.request_id != request_id)

    def before_step(self) -> None:
        # First come first served: a request that does not fit keeps those behind it waiting.
        while self.ready:
            expect, handoff = self.ready[0]
            try:
                self.engine.add_handoff(handoff, expect.params, expect.request_id, expect.priority)
            except KVPoolFullError:
                return
            except ValueError as exc:
                self.fail(expect.request_id, f"the decode worker could not take the hand-off: {exc}")
            else:
                self.admitted.append(expect.request_id)
            self.ready.popleft()

    def has_ready_work(self) -> bool:
        return bool(self.ready)

    def has_news(self) -> bool:
        return bool(self.admitted)

    def report(self, outputs: list[RequestOutput], failed: dict[str, str]) -> m.Report:
        admitted, self.admitted = self.admitted, []
        return m.Report(self.worker, outputs, self.stats(pending=len(self.ready) + len(self.orphans)),
                        admitted=admitted, failed=failed)

    def local_state(self) -> dict[str, int]:
        return {"expected": len(self.expected), "aborted_expected": len(self.aborted),
                "orphans": len(self.orphans), "ready": len(self.ready)}

    def _receive_loop(self, prefill: int, channel: KVChannel) -> None:
        while True:
            try:
                handoff = channel.recv(0)
            except Exception as exc:  # noqa: BLE001 - the prefill worker is gone
                self.inbox.put(_PeerLost(prefill, repr(exc)))
                return
            self.inbox.put(_Arrived(prefill, handoff))
