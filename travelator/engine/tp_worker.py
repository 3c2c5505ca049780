"""A tensor-parallel rank other than the driver: it holds its shard of the weights and
its own KV cache (its share of the KV heads), keeps its own copy of each running
request's tokens, and runs each step the driver describes. It never schedules and
never samples: the driver does both, once.

Start one with ``python -m travelator.engine.tp_worker`` in a torchrun-style
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, and
TRAVELATOR_TP_SECRET: see tp_launch). The engine's own launcher does that for one machine;
under ``torchrun`` the engine's constructor turns every rank but 0 into a worker (see
tp_executor.make_executor). A message it cannot authenticate or decode (``tp_protocol``)
breaks the group: the worker exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch

from travelator.engine.control_codec import RefusedMessage
from travelator.engine.model_runner import ModelRunner
from travelator.engine.scheduler_output import SchedulerOutput
from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.engine.tp_launch import LaunchEnv, connect_store, control_secret, launch_env
from travelator.engine.tp_protocol import CALLS, STOP, TPWorkerSpec, decode_call, decode_spec, encode_result
from travelator.model.arch import ModelArch
from travelator.model.loader import WeightIterator
from travelator.model.pp_stage import PipelineStage
from travelator.model.tp_auth import ControlAuthError
from travelator.model.tp_group import TPGroup

logger = logging.getLogger(__name__)


def check_gpu_for_rank(device_type: str, local_rank: int) -> None:
    """On CUDA each rank of a machine takes its own GPU, cuda:LOCAL_RANK: refuse a rank with
    no GPU of its own (else it dies on "invalid device ordinal" and the driver only learns
    that it died). The driver asks for its highest local rank before launching any worker."""
    if device_type == "cuda" and local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor parallelism on CUDA puts each rank on its own GPU: LOCAL_RANK "
                         f"{local_rank} needs cuda:{local_rank}, {torch.cuda.device_count()} GPU(s) visible")


def rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        check_gpu_for_rank(device_type, local_rank)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device(device_type)


def build_runner(spec: TPWorkerSpec, arch: ModelArch, weights: WeightIterator | None, device: torch.device,
                 group: TPGroup, grammars: GrammarCompiler | None = None) -> ModelRunner:
    """This rank's runner: its tensor-parallel shard, or its pipeline stage's layers."""
    if spec.pipeline:
        return ModelRunner(spec.model, arch, weights, spec.on(device),
                           stage=PipelineStage.of(group, arch.num_layers), grammars=grammars)
    return ModelRunner(spec.model, arch, weights, spec.on(device), tp=group, grammars=grammars)


class Worker:
    """The rank-local operations, the same on every rank (the driver has one too).

    A message from the driver names one of ``tp_protocol.CALLS`` with its arguments: the
    method runs on every rank, and for a call that replies the results are gathered on the
    driver.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def step(self, out: SchedulerOutput, sampled: list[tuple[str, int]]) -> None:
        """Run one step without sampling: the driver samples from the gathered logits.

        ``sampled`` are the tokens the driver sampled in the previous step; they extend
        this rank's copies of the sequences before the step's changes apply, exactly as
        they extended the driver's when it sampled them.
        """
        self.runner.follow(out, sampled)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, block_size)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: its weights and its KV cache."""
        r = self.runner
        return {
            "weights": sum(p.numel() * p.element_size() for p in r.model.parameters()),
            "kv_cache": sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                            for k, v in r.kv_caches),
        }

    def held_request_ids(self) -> set[str]:
        return self.runner.held_request_ids()


def watch_parent(parent_pid: int) -> None:
    """Exit when the engine process that launched us is gone (no orphans)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(1.0)


def run_worker(env: LaunchEnv | None = None) -> None:
    """Serve the driver's steps until it says stop (or goes away)."""
    env = env or launch_env()
    if env is None:
        raise RuntimeError("a tensor-parallel worker needs RANK, WORLD_SIZE, MASTER_ADDR and "
                           "MASTER_PORT in its environment (torchrun sets them)")
    if env.rank == 0:
        raise RuntimeError("rank 0 is the driver: it runs the engine, not the worker loop")
    parent = os.environ.get("TRAVELATOR_TP_PARENT_PID")
    if parent:  # launched by the engine on this machine
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
        threading.Thread(target=watch_parent, args=(int(parent),), daemon=True).start()
    threads = os.environ.get("TRAVELATOR_TP_THREADS")
    if threads:
        torch.set_num_threads(int(threads))

    group = TPGroup(connect_store(env), env.rank, env.world_size, control_secret(env))
    spec = decode_spec(group.broadcast_bytes())
    group.expert_parallel = spec.expert_parallel
    device = rank_device(spec.device_type, env.local_rank)
    group.connect_data(device)

    from travelator.model.loader import open_model

    source = open_model(spec.model.model, spec.model.load_format)
    worker = Worker(build_runner(spec, source.arch, source.weights, device, group))
    while True:
        method, args = decode_call(group.broadcast_bytes())
        if method == STOP:
            break
        result = getattr(worker, method)(*args)  # a method of CALLS only: decode_call refuses others
        if CALLS[method].reply:
            group.gather_bytes(encode_result(method, result))


def main() -> None:
    logging.basicConfig(level=os.environ.get("TRAVELATOR_LOG_LEVEL", "WARNING"))
    try:
        run_worker()
    except Exception as exc:
        rank = os.environ.get("RANK")
        if isinstance(exc, (RefusedMessage, ControlAuthError)):
            print(f"travelator tensor-parallel worker {rank}: refused a control message ({exc}); exiting",
                  file=sys.stderr, flush=True)
        elif "gloo" in str(exc):  # how a worker learns that the driver (or a peer) is gone
            print(f"travelator tensor-parallel worker {rank}: lost the group ({exc}); exiting",
                  file=sys.stderr, flush=True)
        else:
            print(f"travelator tensor-parallel worker {rank} failed:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
