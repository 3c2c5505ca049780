"""The driver's side of tensor parallelism (Orca's split of control and data).

The engine process is rank 0, the driver: it schedules, once, and samples, once. Each
step it sends every worker only the small step description (the ``SchedulerOutput``:
new requests in full, running ones as changes, freed ids) plus the tokens it sampled in
the previous step, over the gloo control group (encoded by ``tp_protocol``, authenticated
with the group's secret: see tp_launch). Then every rank runs the same step on its
shard; the tensors move over the data group (all-reduces inside the model, the gather of
the vocabulary-split logits to the driver). Every rank therefore executes exactly the
same schedule (docs/design.md invariant 9), and the workers' copies of the sequences stay equal
to the driver's.

A worker that dies breaks the group: gloo reports the closed connection at once, the
executor turns that into ``TensorParallelError("tensor-parallel worker 1 died (exit code
-9)")``, stops the other workers, and refuses every later step. The engine re-raises it.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from travelator.config import ModelConfig, ParallelConfig
from travelator.engine.executor import Executor
from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.engine.model_runner import LaunchedStep, ModelRunner, RunnerSettings
from travelator.engine.ray_placement import place_ranks
from travelator.engine.scheduler_output import RunnerOutput, SchedulerOutput
from travelator.engine.tp_launch import SECRET_ENV, LaunchEnv, connect_store, control_secret, host_store, launch_env
from travelator.engine.tp_protocol import CALLS, STOP, TPWorkerSpec, decode_result, encode_call, encode_result, encode_spec
from travelator.engine.tp_worker import Worker, build_runner, check_gpu_for_rank, rank_device, run_worker
from travelator.model.arch import ModelArch
from travelator.model.loader import ModelSource, WeightIterator
from travelator.model.pp_stage import stage_bounds
from travelator.model.tp_group import TPGroup, check_divisible

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a worker died, a collective failed): the
    engine cannot go on."""


def make_executor(parallel: ParallelConfig, model: ModelConfig, arch: ModelArch,
                  weights: WeightIterator | None, settings: RunnerSettings, *,
                  grammars: GrammarCompiler | None = None, draft: ModelSource | None = None) -> Executor:
    """A plain ModelRunner for one rank, or the driver of a tensor-parallel group.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), every rank but 0
    becomes a worker here and never returns: it serves the driver's steps and then
    exits the process.
    """
    size = parallel.world_size
    pipeline = parallel.pipeline_parallel_size > 1
    env = launch_env()
    if env is None and size == 1:
        return ModelRunner(model, arch, weights, settings, grammars=grammars, draft=draft)
    if pipeline:
        stage_bounds(arch.num_layers, size, 0)  # every stage gets a layer: refused before any launch
    else:
        check_divisible(arch, size, parallel.expert_parallel)
    if env is not None and env.world_size != size:
        flag = "--pipeline-parallel-size" if pipeline else "--tensor-parallel-size"
        raise ValueError(f"launched with WORLD_SIZE={env.world_size} but the engine has {size} "
                         f"ranks: pass {flag} {env.world_size}")
    if env is not None and parallel.distributed_executor_backend == "ray":
        raise ValueError("--distributed-executor-backend ray places the ranks itself: start one "
                         "process (not torchrun)")
    if env is not None and env.rank != 0:
        run_worker(env)
        raise SystemExit(0)
    return TPExecutor(TPWorkerSpec(model, settings, parallel.expert_parallel, pipeline), arch, weights, size, env,
                      grammars, ray=parallel.distributed_executor_backend == "ray")


class _Group:
    """What the clean-up needs, kept apart from the executor so a finalizer can hold it."""

    def __init__(self) -> None:
        self.group: TPGroup | None = None
        self.procs: list[subprocess.Popen] = []  # or ray_placement.RayRank, which answers the same
        self.release: Callable[[], None] | None = None  # what else the workers hold (a Ray placement group)
        self.graceful = True
        # One message at a time on the control group: a step on the engine's thread and a
        # clean-up at exit (another thread) must not interleave.
        self.lock = threading.RLock()


def _close(g: _Group) -> None:
    """Stop the workers: a stop message when the group is sound, then signals."""
    if g.group is not None and g.graceful and g.lock.acquire(timeout=5.0):
        try:
            g.group.broadcast_bytes(encode_call(STOP, ()))
        except Exception:
            pass
        finally:
            g.lock.release()
    deadline = time.monotonic() + (5.0 if g.graceful else 0.0)
    for p in g.procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in g.procs:
        if p.poll() is None:
            p.terminate()
    for p in g.procs:
        try:
            p.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    g.group = None
    if g.release is not None:
        g.release()
        g.release = None


class TPExecutor:
    """Rank 0 of a tensor-parallel group, behind the engine's ``Executor`` interface."""

    def __init__(self, spec: TPWorkerSpec, arch: ModelArch, weights: WeightIterator | None,
                 size: int, env: LaunchEnv | None, grammars: GrammarCompiler | None = None, *,
                 ray: bool = False) -> None:
        self._ray = ray  # place the workers on a Ray cluster instead of launching them here
        self._grammars = grammars  # the driver's runner masks constrained rows with it
        self.size = size
        self._g = _Group()
        self._finalizer = weakref.finalize(self, _close, self._g)
        self._error: str | None = None
        self._sampled: list[tuple[str, int]] = []
        # Pipeline parallelism: the steps sent off, oldest first, and what waits until the
        # last step message has reached every rank.
        self._flights: deque[LaunchedStep] = deque()
        self._delivery: Callable[[], None] | None = None
        self.most_in_flight = 0  # the most steps in flight at once so far
        self.runner: ModelRunner | None = None  # the driver's own shard, once the group is up
        try:
            self._start(spec, arch, weights, env)
        except BaseException as exc:
            self._g.graceful = False
            dead = self._dead_workers()
            self._finalizer()
            if dead and not isinstance(exc, TensorParallelError):
                raise TensorParallelError(self._death_message(dead) + " while starting") from exc
            raise

    def _start(self, spec: TPWorkerSpec, arch: ModelArch, weights: WeightIterator | None,
               env: LaunchEnv | None) -> None:
        t0 = time.perf_counter()
        if env is None and self._ray:
            placed = place_ranks(self.size, spec.device_type)
            self._g.procs, self._g.release = placed.ranks, placed.release
            self._server, store, key, local_rank = placed.server, placed.store, placed.secret, 0
        elif env is None:  # launch the workers on this machine
            check_gpu_for_rank(spec.device_type, self.size - 1)
            server = host_store("127.0.0.1", 0, self.size)
            store = dist.PrefixStore("travelator/", server)
            self._server = server  # the store lives as long as the group
            local = LaunchEnv(0, self.size, 0, "127.0.0.1", server.port)
            # A fresh secret per engine, in the environment of its own workers only.
            secret = secrets.token_hex(32)
            self._g.procs = [self._launch(rank, local, spec.device_type, secret)
                             for rank in range(1, self.size)]
            key = secret.encode()
            local_rank = 0
        else:
            store = None
            key = control_secret(env)
            local_rank = env.local_rank
        group = self._watched(lambda: TPGroup(store if store is not None else connect_store(env),
                                              0, self.size, key))
        self._g.group = self.group = group
        group.expert_parallel = spec.expert_parallel
        group.broadcast_bytes(encode_spec(spec))
        device = rank_device(spec.device_type, local_rank)
        self._watched(lambda: group.connect_data(device))
        self.runner = build_runner(spec, arch, weights, device, group, self._grammars)
        self._what = "pipeline parallel over {} stages" if spec.pipeline else "tensor parallel over {} ranks"
        self.worker = Worker(self.runner)
        if device.type == "cuda" and self._g.procs:
            threading.Thread(target=self._watch_workers, name="travelator-tp-watch",
                             daemon=True).start()
        logger.info("tensor parallel: %d ranks (%s), driver ready in %.1f s", self.size,
                    "torchrun" if env else "Ray actors" if self._ray else "local workers", time.perf_counter() - t0)

    # ---- start-up --------------------------------------------------------------------
    def _launch(self, rank: int, local: LaunchEnv, device_type: str, secret: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        path = [p for p in sys.path if p]
        if env.get("PYTHONPATH"):
            path.insert(0, env["PYTHONPATH"])
        env.update(
            RANK=str(rank), WORLD_SIZE=str(local.world_size), LOCAL_RANK=str(rank),
            MASTER_ADDR=local.master_addr, MASTER_PORT=str(local.master_port),
            TRAVELATOR_TP_PARENT_PID=str(os.getpid()), PYTHONPATH=os.pathsep.join(path),
            **{SECRET_ENV: secret},
        )
        if device_type == "cpu" and "TRAVELATOR_TP_THREADS" not in env:
            env["TRAVELATOR_TP_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.size))
        return subprocess.Popen([sys.executable, "-m", "travelator.engine.tp_worker"], env=env)

    def _watched(self, fn: Callable[[], Any]) -> Any:
        """Run a blocking rendezvous step, failing at once if a local worker dies meanwhile."""
        result: list[Any] = []
        error: list[BaseException] = []

        def target() -> None:
            try:
                result.append(fn())
            except BaseException as e:
                error.append(e)

        t = threading.Thread(target=target, name="travelator-tp-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.05)
            dead = self._dead_workers()
            if dead:
                raise TensorParallelError(self._death_message(dead) + " while starting")
        if error:
            raise TensorParallelError(f"tensor-parallel start-up failed: {error[0]}") from error[0]
        return result[0]

    def _watch_workers(self) -> None:
        """On CUDA a dead peer can stall NCCL collectives: abort them when a worker dies."""
        while self._g.group is not None and self._error is None:
            if self._dead_workers():
                self.group.abort()
                return
            time.sleep(0.5)

    # ---- failures ----------------------------------------------------------------------
    def _dead_workers(self) -> list[tuple[int, int]]:
        return [(rank, p.returncode) for rank, p in enumerate(self._g.procs, start=1)
                if p.poll() is not None]

    @staticmethod
    def _death_message(dead: list[tuple[int, int]]) -> str:
        return "; ".join(f"tensor-parallel worker {rank} died (exit code {code})"
                         for rank, code in dead)

    def _broken(self, exc: BaseException | None) -> TensorParallelError:
        """Record why the group broke, stop the workers, and make the error to raise."""
        dead = self._dead_workers()
        deadline = time.monotonic() + 2.0
        while not dead and self._g.procs and exc is not None and time.monotonic() < deadline:
            time.sleep(0.02)  # a killed peer's connection closes just before it is reaped
            dead = self._dead_workers()
        if dead:
            msg = self._death_message(dead)
        elif self._g.procs:
            msg = f"tensor-parallel step failed: {type(exc).__name__}: {exc}"
        else:
            msg = f"tensor-parallel step failed (did a rank die?): {type(exc).__name__}: {exc}"
        self._error = msg
        self._flights.clear()
        logger.error("%s; stopping the tensor-parallel workers", msg)
        self._g.graceful = False
        if self._g.group is not None:
            self._g.group.abort()
        self._finalizer()
        return TensorParallelError(msg)

    def _ensure_alive(self) -> None:
        if self._error is not None:
            raise TensorParallelError(self._error)
        if self._dead_workers():
            raise self._broken(None)

    # ---- the Executor interface ----------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block(block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.call("allocate_kv_cache", num_blocks, block_size)

    def describe(self) -> str:
        return f"{self.runner.describe()}; {self._what.format(self.size)}"

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        with self._g.lock:
            self._ensure_alive()
            sampled, self._sampled = self._sampled, []
            try:
                self._delivered()
                self.group.broadcast_bytes(encode_call("step", (out, sampled)))
                result = self.runner.execute(out)
            except Exception as exc:
                raise self._broken(exc) from exc
            self._sampled = [(rid, tok.token_id) for rid, toks in result.sampled.items() for tok in toks]
            return result

    # ---- pipeline parallelism: steps in flight ---------------------------------------------
    def launch(self, out: SchedulerOutput) -> None:
        """Send a step off without waiting for its tokens: the other stages take it when they
        are done with the steps before it; the driver runs its own stage and returns."""
        with self._g.lock:
            self._ensure_alive()
            sampled, self._sampled = self._sampled, []
            try:
                self._delivered()
                self._delivery = self.group.post_broadcast_bytes(encode_call("step", (out, sampled)))
                self._flights.append(self.runner.launch(out))
                self.most_in_flight = max(self.most_in_flight, len(self._flights))
            except Exception as exc:
                raise self._broken(exc) from exc

    def land(self) -> RunnerOutput:
        """The tokens of the oldest step in flight."""
        with self._g.lock:
            self._ensure_alive()
            try:
                result = self.runner.land(self._flights.popleft())
            except Exception as exc:
                raise self._broken(exc) from exc
            self._sampled += [(rid, tok.token_id) for rid, toks in result.sampled.items() for tok in toks]
            return result

    @property
    def num_in_flight(self) -> int:
        return len(self._flights)

    def _delivered(self) -> None:
        """Wait until the last step message sent off has reached every rank."""
        if self._delivery is not None:
            delivery, self._delivery = self._delivery, None
            delivery()

    @property
    def phase_times(self) -> dict[str, float]:
        return self.runner.phase_times

    def read_kv_blocks(self, block_ids: list[int]):
        raise ValueError("a KV hand-off needs tensor_parallel_size 1")

    def write_kv_blocks(self, block_ids: list[int], data) -> None:
        raise ValueError("a KV hand-off needs tensor_parallel_size 1")

    def held_request_ids(self) -> set[str]:
        return set().union(*self.call("held_request_ids"))

    def call(self, method: str, *args: Any) -> list[Any]:
        """Run a ``Worker`` method of ``tp_protocol.CALLS`` that replies on every rank; the
        results in rank order."""
        if method not in CALLS or not CALLS[method].reply:
            raise ValueError(f"{method!r} is not a tensor-parallel call with a reply")
        with self._g.lock:
            self._ensure_alive()
            try:
                self._delivered()
                self.group.broadcast_bytes(encode_call(method, args))
                own = encode_result(method, getattr(self.worker, method)(*args))
                results = [decode_result(method, data) for data in self.group.gather_bytes(own)]
            except Exception as exc:
                raise self._broken(exc) from exc
            return results

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers this engine launched (empty under torchrun)."""
        return [p.pid for p in self._g.procs]

    def shutdown(self) -> None:
        """Stop the workers (idempotent; also runs at garbage collection and exit)."""
        with self._g.lock:
            if self._error is None:
                self._error = "the tensor-parallel engine has been shut down"
        self._finalizer()
        if self.runner is not None:  # not when the group failed to start
            self.runner.shutdown()
