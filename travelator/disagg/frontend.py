"""The front end of a disaggregated server: ``DisaggregatedFrontEnd``, an ``EngineClient``
(``engine/client.py``) that drives worker processes instead of an engine of its own.

It starts the workers (``worker.py``) and waits until each is ready; the requests' state machine
is its ``Router`` (``router.py``). It validates requests itself (it loads the tokenizer, not the
model); what it reports of its workers (snapshot, self-check, per-worker metrics) is in
``front_report.py``. All that state lives on the event loop's thread; two threads only pass
what they see to it: the workers' reports, and processes that exited.

A worker that dies fails only the requests it held (``finish_reason="error"``, saying which
worker); the others go on, ``degraded`` says what is missing (``/health`` shows it). When no
worker of a role is left, the engine is dead, as a single engine whose loop stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from travelator.config import REQUEST_LEVEL_BATCHING, EngineConfig
from travelator.disagg import messages as m
from travelator.disagg.front_report import WorkerMetrics, combine_reports, front_snapshot
from travelator.disagg.hosts import publish_front_end, worker_ranks
from travelator.disagg.placement import Placement
from travelator.disagg.ray_workers import RayWorkers
from travelator.disagg.remote import RemoteWorker, accept_workers
from travelator.disagg.router import Router
from travelator.disagg.worker import DisaggWorkerSpec, run_worker
from travelator.engine.client import (
    DeathListener,
    EngineDeadError,
    EngineSnapshot,
    RequestSpec,
    ServedModel,
    StepListener,
    call_listeners,
    stream_outputs,
)
from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.engine.outputs import RequestOutput
from travelator.engine.request import Request
from travelator.engine.request_factory import RequestFactory
from travelator.engine.tp_launch import LaunchEnv, connect_store, control_secret, host_store
from travelator.model.loader import open_model

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DisaggConfig:
    num_prefill: int = 1
    num_decode: int = 1
    threads_per_worker: int | None = None  # default: this machine's cores shared out
    start_timeout_s: float = 300.0
    # Under torchrun: this is rank 0, and the other ranks run the workers dealt to them
    # (``hosts.py``). None: every worker on this machine.
    launch: LaunchEnv | None = None

    def validate(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a disaggregated server needs at least one prefill and one decode worker")

    @classmethod
    def parse(cls, text: str) -> "DisaggConfig":
        """``"P:D"``, e.g. ``"1:1"``: P prefill and D decode workers."""
        try:
            p, d = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"--disaggregate takes PREFILL:DECODE worker counts, e.g. 1:1; got {text!r}") from None
        cfg = cls(p, d)
        cfg.validate()
        return cfg


class DisaggregatedFrontEnd:
    """Start the workers (returns once every one is ready) and serve through them."""

    def __init__(self, config: EngineConfig, disagg: DisaggConfig) -> None:
        config = _worker_config(config, disagg)
        self.config = config
        self.disagg = disagg
        self.workers = [m.WorkerId(m.PREFILL, i) for i in range(disagg.num_prefill)] + \
                       [m.WorkerId(m.DECODE, i) for i in range(disagg.num_decode)]
        self.stats: dict[m.WorkerId, m.WorkerStats] = {}
        self.dead: dict[m.WorkerId, str] = {}
        self._broken_links: set[m.WorkerId] = set()  # decode workers alive after a failed send
        self.step_listeners: list[StepListener] = []
        self.death_listeners: list[DeathListener] = []
        self.error: BaseException | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._accepting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._checks: dict[int, tuple[asyncio.Future, dict[m.WorkerId, dict]]] = {}
        self._check_ids = itertools.count()
        self._stopped = threading.Event()
        self.processes: dict[m.WorkerId, multiprocessing.Process | RemoteWorker] = {}
        self._commands: dict[m.WorkerId, object] = {}  # each worker's queue, or its connection
        self._event_pipes: dict[object, m.WorkerId] = {}  # each worker's own (see run_worker)
        self._ray: RayWorkers | None = None  # the workers' Ray actors, when Ray places them
        try:
            self._start_workers()
            ready = self._wait_ready(disagg.start_timeout_s)
        except BaseException:
            self.stop(1.0)
            raise
        block_sizes = {r.block_size for r in ready.values()}
        self.block_size = block_sizes.pop()
        self.pids = {w: r.pid for w, r in ready.items()}
        placement = Placement(disagg.num_prefill,
                              [ready[m.WorkerId(m.DECODE, i)].num_blocks for i in range(disagg.num_decode)])
        self.router = Router(placement, self.block_size, self._send, self._push)
        self.served_model, self._requests = _validation(config, min(r.max_model_len for r in ready.values()))
        self.metric_collectors = (WorkerMetrics(self),)

    def _start_workers(self) -> None:
        disagg, launch = self.disagg, self.disagg.launch
        if self.config.parallel.distributed_executor_backend == "ray":  # every worker an actor
            self._ray = RayWorkers(self.workers, disagg.threads_per_worker or 1)
            where: dict[m.WorkerId, object] = dict(self._ray.nodes)  # each worker's node
            host, local = self._ray.host, []
        else:
            where = worker_ranks(disagg.num_prefill, disagg.num_decode, launch.world_size if launch else 1)
            host = launch.master_addr if launch else "127.0.0.1"
            local = [w for w in self.workers if where[w] == 0]
        # Across hosts the KV store and the workers' connections listen where the other hosts
        # reach this one, and gloo binds that address.
        self._store = host_store(host, 0, 1, disagg.start_timeout_s)
        threads = disagg.threads_per_worker or max(1, (os.cpu_count() or 1) // max(1, len(local)))

        def spec_of(w: m.WorkerId) -> DisaggWorkerSpec:
            on_host = sum(h == where[w] for h in where.values())  # their KV pools share its memory
            config = dataclasses.replace(self.config, cache=dataclasses.replace(
                self.config.cache, kv_memory_share=self.config.cache.kv_memory_share / on_host))
            return DisaggWorkerSpec(w, config, host, self._store.port, disagg.num_prefill, disagg.num_decode,
                                    threads, os.getpid(), disagg.start_timeout_s, host if launch else None)

        ctx = multiprocessing.get_context("spawn")
        for w in local:
            self._commands[w] = ctx.Queue()
            events, worker_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_worker, args=(spec_of(w), self._commands[w], worker_end),
                               name=f"travelator-{w.role}-{w.index}", daemon=True)
            proc.start()
            worker_end.close()  # the worker holds it now: its exit ends the stream
            self._event_pipes[events] = w
            self.processes[w] = proc
        if len(local) < len(self.workers):
            self._accept_remote(host, {w for w in self.workers if w not in local}, spec_of)

    def _accept_remote(self, host: str, remote: set[m.WorkerId],
                       spec_of: Callable[[m.WorkerId], DisaggWorkerSpec]) -> None:
        """Wait for the workers on other hosts to connect: those of torchrun's other ranks
        (``hosts.py``), or every worker, each in its Ray actor (``ray_workers.py``)."""
        launch, ray = self.disagg.launch, self._ray
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((host, 0), family=family) as listener:
            port = listener.getsockname()[1]
            if ray is not None:
                ray.start(port, self.disagg.start_timeout_s)
                secret, check = ray.secret, ray.check
            else:
                secret, check = control_secret(launch), None
                self._launch_store = connect_store(launch)  # kept: under a plain launcher this rank hosts it
                publish_front_end(self._launch_store, host, port)
            connected = accept_workers(listener, remote, secret, spec_of, self.disagg.start_timeout_s, check)
        for w, worker in connected.items():
            self.processes[w] = self._commands[w] = worker
            self._event_pipes[worker] = w
        if ray is not None:
            ray.watch(connected)

    def _wait_ready(self, timeout_s: float) -> dict[m.WorkerId, m.Ready]:
        ready: dict[m.WorkerId, m.Ready] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(self.workers):
            for w, proc in self.processes.items():
                if not proc.is_alive() and w not in ready:
                    raise RuntimeError(f"the {w} ended ({_exit_reason(proc)}) before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers were not ready in {timeout_s} s")
            for ev in self._receive_events(0.5):
                if isinstance(ev, m.Died):
                    raise RuntimeError(f"the {ev.worker} failed to start: {ev.error}")
                if isinstance(ev, m.Ready):
                    ready[ev.worker] = ev
        return ready

    def _receive_events(self, timeout_s: float) -> list:
        """What the workers sent, waiting up to ``timeout_s`` for something."""
        events = []
        for pipe in multiprocessing.connection.wait(list(self._event_pipes), timeout_s):
            try:
                events.append(pipe.recv())
            except (EOFError, OSError, pickle.UnpicklingError):  # its worker exited (the watcher says so)
                del self._event_pipes[pipe]
                pipe.close()
        return events

    # ---- lifecycle ----------------------------------------------------
    def start(self) -> None:
        """Serve on the running event loop. Again on a later loop (a benchmark's next run): the
        reports go there from then on."""
        first = self._loop is None
        self._loop = asyncio.get_running_loop()
        if first:
            threading.Thread(target=self._read_events, name="travelator-disagg-events", daemon=True).start()
            threading.Thread(target=self._watch_processes, name="travelator-disagg-watch", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        for w, proc in self.processes.items():
            if proc.is_alive():
                self._commands[w].put(m.STOP)
        deadline = time.monotonic() + timeout
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        if self._ray is not None:
            self._ray.release()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._loop is not None and not self._stopped.is_set()

    @property
    def degraded(self) -> str | None:
        """What is missing while the server still serves (None: nothing)."""
        if not self.dead:
            return None
        return "; ".join(f"{w} died ({why})" for w, why in self.dead.items())

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def step_running_for(self) -> float:
        return 0.0  # each worker has its own loop; a stuck worker is seen by its silence

    def stop_accepting(self) -> None:
        self._accepting = False

    def snapshot(self) -> EngineSnapshot:
        return front_snapshot(self)

    def live_batch(self) -> None:
        return None  # each worker has its own batch (see /metrics for per-worker figures)

    def live_stats(self) -> list[m.WorkerStats]:
        return [s for w, s in self.stats.items() if w not in self.dead]

    def declare_dead(self, exc: BaseException) -> None:
        if self.error is not None:
            return
        self.error = exc
        for rid in list(self._streams):
            self._push(rid, exc)
        call_listeners(self.death_listeners, "death", exc)

    # ---- requests ---------------------------------------------------------------------
    def make_request(self, spec: RequestSpec) -> Request:
        return self._requests.make_request(spec)

    def submit(self, request: Request) -> asyncio.Queue:
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        if request.sampling_params.structured is not None:
            raise ValueError("structured outputs are not supported with --disaggregate: the grammar's "
                             "state does not move with the KV")
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        self.router.add(request)  # raises, changing nothing, for an id still in use
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = stream
        return stream

    def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        return stream_outputs(self, spec)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.router.abort(request_id)

    def abort_all(self) -> None:
        for rid in list(self._streams):
            self.abort(rid)

    def _send(self, worker: m.WorkerId, command) -> None:
        if worker not in self.dead:
            self._commands[worker].put(command)

    # ---- what the workers report (on the event loop) --------------------------------------
    def _read_events(self) -> None:
        # Until every worker has exited: one blocked in sending a report could not read STOP.
        while self._event_pipes:
            for ev in self._receive_events(1.0):
                try:
                    self._loop.call_soon_threadsafe(self._on_event, ev)
                except RuntimeError:  # that loop has closed (between a benchmark's runs): a report at rest
                    continue

    def _on_event(self, ev) -> None:
        if isinstance(ev, m.Report):
            self._on_report(ev)
        elif isinstance(ev, m.CheckReport):
            entry = self._checks.get(ev.token)
            if entry is not None:
                fut, reports = entry
                reports[ev.worker] = ev.report
                if not fut.done() and all(w in reports or w in self.dead for w in self.workers):
                    fut.set_result(None)
        elif isinstance(ev, m.Died):
            self._on_death(ev.worker, ev.error.splitlines()[0])

    def _on_report(self, rep: m.Report) -> None:
        if rep.worker in self.dead:
            return
        self.stats[rep.worker] = rep.stats
        for d in rep.lost_peers:
            # A send fails when its decode worker dies, often before its process watcher says
            # so: attribute the failure to the death, as every other request of that worker.
            peer = m.WorkerId(m.DECODE, d)
            if peer in self.dead or peer in self._broken_links:
                continue
            proc = self.processes[peer]
            proc.join(1.0)
            if not proc.is_alive():
                self._on_death(peer, _exit_reason(proc))
            else:  # alive: its pair broke; its requests fail with the transfer error, once waited for
                self._broken_links.add(peer)
        delivered = self.router.on_report(rep)
        if rep.step is not None:
            call_listeners(self.step_listeners, "step", rep.step, delivered)

    def _push(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        stream.put_nowait(item)


    # ---- faults ---------------------------------------------------------------------------
    def _watch_processes(self) -> None:
        sentinels = {proc.sentinel: w for w, proc in self.processes.items()}
        while sentinels and not self._stopped.is_set():
            for s in multiprocessing.connection.wait(list(sentinels), timeout=1.0):
                w = sentinels.pop(s)
                if self._stopped.is_set():
                    return
                self.processes[w].join(1.0)  # reap it, for its exit code
                why = _exit_reason(self.processes[w])
                try:
                    self._loop.call_soon_threadsafe(self._on_death, w, why)
                except RuntimeError:  # that loop has closed; the next start() sees it dead
                    self.dead.setdefault(w, why)

    def _on_death(self, worker: m.WorkerId, why: str) -> None:
        if worker in self.dead or self._stopped.is_set():
            return
        logger.error("the %s died (%s): failing its requests", worker, why)
        self.dead[worker] = why
        self.router.on_death(worker, why)
        for fut, reports in self._checks.values():
            if not fut.done() and all(w in reports or w in self.dead for w in self.workers):
                fut.set_result(None)
        placement = self.router.placement
        if not placement.alive(m.PREFILL) or not placement.alive(m.DECODE):
            self.declare_dead(EngineDeadError(f"no {worker.role} worker is left: {self.degraded}"))

    # ---- self-check -----------------------------------------------------------------------
    async def self_check(self, timeout: float = 30.0) -> dict:
        """Every live worker's ``engine_self_check`` and the front end's own maps, in the shape
        of the single engine's report (KV and requests added up over the live workers)."""
        token = next(self._check_ids)
        fut = asyncio.get_running_loop().create_future()
        reports: dict[m.WorkerId, dict] = {}
        self._checks[token] = (fut, reports)
        for w in self.workers:
            self._send(w, m.Check(token))
        if all(w in self.dead for w in self.workers):
            fut.set_result(None)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"workers did not answer the self-check in {timeout} s: "
                               f"{[str(w) for w in self.workers if w not in reports and w not in self.dead]}") from None
        finally:
            self._checks.pop(token, None)
        return combine_reports(self, reports)


def _exit_reason(proc: multiprocessing.Process | RemoteWorker) -> str:
    if isinstance(proc, RemoteWorker):
        return proc.why or "its connection ended"
    return f"exit code {proc.exitcode}"


def _worker_config(config: EngineConfig, disagg: DisaggConfig) -> EngineConfig:
    """``config`` checked for disaggregation (each worker's share of its host's memory is set
    in its spec)."""
    disagg.validate()
    config.validate()
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("--disaggregate runs each worker on one rank (tensor_parallel_size 1)")
    if disagg.launch is not None and config.parallel.distributed_executor_backend == "ray":
        raise ValueError("--distributed-executor-backend ray places the workers itself: start one "
                         "process (not torchrun)")
    if config.scheduler.batching in REQUEST_LEVEL_BATCHING:
        raise ValueError(f"--disaggregate needs iteration-level batching (iteration or orca), not "
                         f"{config.scheduler.batching}: a decode worker admits each request as its KV comes")
    if config.scheduler.speculative_method == "draft":
        raise ValueError("--disaggregate does not move a draft model's cache: use ngram speculation or none")
    if config.cache.kv_events() is not None:
        raise ValueError("--kv-events-config publishes one engine's cache: with --disaggregate every "
                         "worker would bind the same endpoint (not supported yet)")
    return config


def _validation(config: EngineConfig, max_model_len: int) -> tuple[ServedModel, RequestFactory]:
    """The served model's facts and a request factory, from its tokenizer alone: the front end
    validates requests itself and loads no weights."""
    source = open_model(config.model.model, config.model.load_format)
    vocab_size = source.arch.vocab_size
    grammars = GrammarCompiler(source.tokenizer, vocab_size)
    eos = frozenset(source.tokenizer.eos_token_ids) | frozenset(source.arch.eos_token_ids)
    requests = RequestFactory(source.tokenizer, vocab_size, max_model_len, eos, grammars)
    served = ServedModel(source.name, source.tokenizer, vocab_size, max_model_len, grammars,
                         source.arch.hidden_size, source.arch.matryoshka_dimensions,
                         kv_block_size=config.cache.block_size, max_num_seqs=config.scheduler.max_num_seqs)
    return served, requests
