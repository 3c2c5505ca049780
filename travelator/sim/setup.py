"""What ``travelator simulate``'s arguments describe: the engine settings, the KV pool, the
cost model, the workload and its arrivals."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from travelator.bench.arrivals import parse_rate
from travelator.bench.commands import build_workload
from travelator.bench.compare import BATCHING_MODES, MODE_ALIASES
from travelator.bench.workloads import Workload
from travelator.default_model import resolve_model
from travelator.engine.block_manager import blocks_for
from travelator.engine_args import engine_config, engine_kwargs
from travelator.sim.cost_model import CostModel, LinearCostModel
from travelator.sim.roofline import Hardware, ModelShape, RooflineCostModel
from travelator.sim.simulator import SimSetup
from travelator.sim.disagg import HandoffTime
from travelator.sim.sweep import DISAGGREGATED, Arrivals
from travelator.sim.trace import load_trace

# A model given only by its shape file has no context length of its own.
DEFAULT_CONTEXT = 2048


@dataclass(slots=True)
class SimulationSpec:
    setup: SimSetup
    cost: CostModel
    cost_name: str
    model: str
    workload: Workload
    arrivals: Arrivals
    rates: list[float | None]  # None: the trace's own arrival times
    modes: list[str]
    trace_path: str | None
    handoff: HandoffTime | None = None  # the disaggregated mode's KV transfer

    def describe(self) -> dict:
        s = self.setup
        return {"model": self.model, "cost_model": self.cost_name, "modes": self.modes,
                "max_num_seqs": s.scheduler.max_num_seqs,
                "max_num_batched_tokens": s.scheduler.max_num_batched_tokens,
                "num_kv_blocks": s.num_kv_blocks, "block_size": s.cache.block_size,
                "prefix_caching": s.cache.enable_prefix_caching, "workload": self.workload.summary()}


SIM_MODES = (*BATCHING_MODES, DISAGGREGATED)


def batching_modes(names: list[str]) -> list[str]:
    """The modes asked for, in the history's order."""
    modes = {MODE_ALIASES.get(n, n) for n in names}
    if unknown := sorted(modes - set(SIM_MODES)):
        raise ValueError(f"unknown batching mode(s) {unknown}; choose from {', '.join(SIM_MODES)}")
    return [m for m in SIM_MODES if m in modes]


def build_simulation(args: argparse.Namespace) -> SimulationSpec:
    if (args.cost_model is None) == (args.hardware is None):
        raise ValueError("give one cost model: --cost-model JSON (fitted) or --hardware NAME (roofline)")
    if args.model_shape is not None:
        shape, model = ModelShape.load(args.model_shape), args.model_shape
        context = args.max_model_len or DEFAULT_CONTEXT
    else:
        from travelator.model.loader import open_model

        model = resolve_model(args)
        arch = open_model(model, "dummy").arch
        shape, context = ModelShape.from_arch(arch), args.max_model_len or arch.max_position_embeddings
    config = engine_config(model, **engine_kwargs(args))
    if config.parallel.pipeline_parallel_size > 1:
        raise ValueError("simulate: give the stages as --pipeline-stages (with --hardware), "
                         "not --pipeline-parallel-size")
    scheduler = config.scheduler
    if scheduler.speculative_method == "ngram":
        # An n-gram lookup proposes from the tokens' contents, which a simulation does not
        # have: drafts are counted as a draft model's are, accepted at --draft-acceptance.
        scheduler = dataclasses.replace(scheduler, speculative_method="draft", draft_model="simulated")
    cost, cost_name = _cost_model(args, shape)
    blocks = config.cache.num_kv_blocks
    if blocks is None:
        if isinstance(cost, RooflineCostModel):
            blocks = cost.kv_blocks(config.cache.block_size)
        else:  # what the engine takes on a CPU with memory to spare
            blocks = config.scheduler.max_num_seqs * blocks_for(context, config.cache.block_size)
    setup = SimSetup(scheduler, config.cache, blocks, args.draft_acceptance, args.seed)
    if args.trace is not None:
        workload, times = load_trace(args.trace, shape.vocab_size, args.workload_seed)
        arrivals, rates = Arrivals(trace_times=times), [None]
    else:
        workload = build_workload(args, shape.vocab_size, context)
        arrivals = Arrivals(args.burstiness, args.arrival_seed)
        rates = sorted(parse_rate(r) for r in args.request_rate)
    modes = batching_modes(args.batching_modes)
    handoff = _handoff_time(args, shape, cost) if DISAGGREGATED in modes else None
    return SimulationSpec(setup, cost, cost_name, model, workload, arrivals, rates, modes, args.trace, handoff)


def _handoff_time(args: argparse.Namespace, shape: ModelShape, cost: CostModel) -> HandoffTime:
    """The KV of a prompt over the link between the pools: --handoff-gbps, else the roofline
    hardware's interconnect."""
    latency = 0.0
    if args.handoff_gbps is not None:
        bandwidth = args.handoff_gbps * 1e9
    elif isinstance(cost, RooflineCostModel) and cost.hw.interconnect_bandwidth > 0:
        bandwidth, latency = cost.hw.interconnect_bandwidth, cost.hw.interconnect_latency
    else:
        raise ValueError("the disaggregated mode needs the hand-off link's speed: give --handoff-gbps")
    if not bandwidth > 0:
        raise ValueError("--handoff-gbps must be positive")
    per_token = shape.kv_bytes_per_token
    return lambda tokens: latency + tokens * per_token / bandwidth


def _cost_model(args: argparse.Namespace, shape: ModelShape) -> tuple[CostModel, str]:
    if args.cost_model is not None:
        if args.pipeline_stages != 1:
            # A fitted model times whole steps of one process: nothing in it says how a split
            # would share a step between stages, nor what the sends between them cost.
            raise ValueError("--pipeline-stages needs a roofline (--hardware): a fitted cost model "
                             "times whole steps, not stages")
        return LinearCostModel.load(args.cost_model), f"fitted {args.cost_model}"
    hw = Hardware.load(args.hardware)
    cost = RooflineCostModel(shape, hw, args.tensor_parallel_size, args.pipeline_stages)
    layout = f" x{args.tensor_parallel_size} TP" * (args.tensor_parallel_size > 1)
    layout += f" x{args.pipeline_stages} PP" * (args.pipeline_stages > 1)
    return cost, f"roofline {hw.name}{layout}"
