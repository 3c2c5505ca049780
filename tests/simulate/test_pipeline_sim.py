"""Pipeline stages in flight, against timings worked out by hand: the simulator keeps a step
per stage in flight as the engine does, over the engine's own micro-batches."""

from __future__ import annotations

import pytest

from test_simulator import workload

from travelator.cli import main
from travelator.config import CacheConfig, SchedulerConfig
from travelator.engine.scheduler_output import RunnerOutput, SchedulerOutput
from travelator.sim.cost_model import LinearCostModel, StageTimes, StepShape, pipeline_stages
from travelator.sim.disagg import DisaggregatedSimulation
from travelator.sim.roofline import Hardware, ModelShape, RooflineCostModel
from travelator.sim.simulator import SimSetup, Simulation


class StagedCost:
    """Every step the same time in each stage, whatever it computes (a prompt step costs what
    a decode does), and the same send between two stages."""

    def __init__(self, stages: tuple[float, ...], send: float = 0.0) -> None:
        self.times = StageTimes(stages, send)

    @property
    def pipeline_stages(self) -> int:
        return len(self.times.stages)

    def stage_times(self, shape: StepShape) -> StageTimes:
        return self.times

    def step_seconds(self, shape: StepShape) -> float:
        return self.times.total


def simulate(lengths, arrivals, cost, sim=Simulation, blocks: int = 64, **sched):
    setup = SimSetup(SchedulerConfig(**sched), CacheConfig(block_size=4), blocks)
    return sim(setup, cost).run(workload(*lengths), arrivals)


def test_one_request_gets_a_token_every_pass_through_both_stages():
    # 2 stages of 10 ms. The step that enters at 0 leaves stage 1 at 0.02; meanwhile the engine
    # has nothing else to send (its only request is in flight), so it waits for those tokens,
    # then sends the next decode: a token every two stage times, no overlap possible.
    run = simulate([(4, 4)], [0.0], StagedCost((0.010, 0.010)))
    assert run.results[0].token_times == pytest.approx([0.02, 0.04, 0.06, 0.08])
    assert run.duration_s == pytest.approx(0.08)


def test_two_micro_batches_keep_both_stages_busy():
    # A and B at 0: each step takes half the requests (one). A enters stage 0 at 0 and lands at
    # 0.02; B enters stage 0 when A leaves it (0.01) and lands at 0.03; A's next decode enters
    # when its tokens land, at 0.02, and so on: a step lands every stage time, twice the
    # single request's throughput, each request still a token every two stage times.
    run = simulate([(4, 4), (4, 4)], [0.0, 0.0], StagedCost((0.010, 0.010)), max_num_seqs=2)
    a, b = run.results
    assert a.token_times == pytest.approx([0.02, 0.04, 0.06, 0.08])
    assert b.token_times == pytest.approx([0.03, 0.05, 0.07, 0.09])
    assert [s.t for s in run.steps] == pytest.approx([0.02 + 0.01 * k for k in range(8)])
    assert all(s.stats.num_requests == 1 and s.stats.duration_s == pytest.approx(0.02) for s in run.steps)
    # Both seats busy but for the first and last 10 ms: 16 of 18 seat-centiseconds.
    assert run.step_summary()["time_weighted_occupancy"] == pytest.approx(16 / 18)


def test_four_requests_make_two_micro_batches_of_two():
    run = simulate([(4, 3)] * 4, [0.0] * 4, StagedCost((0.010, 0.010)))
    times = [r.token_times for r in run.results]
    assert times[0] == times[1] == pytest.approx([0.02, 0.04, 0.06])
    assert times[2] == times[3] == pytest.approx([0.03, 0.05, 0.07])
    assert [s.stats.num_requests for s in run.steps] == [2] * 6


def test_the_slowest_stage_sets_the_pace_and_sends_take_their_time():
    # Stage 0 10 ms, stage 1 20 ms, 1 ms between them. A: stage 0 0-0.01, stage 1 0.011-0.031.
    # B: stage 0 0.01-0.02, reaches stage 1 at 0.021 but waits for A until 0.031: lands 0.051.
    # A's decode enters at 0.031 (its tokens back), waits for stage 1 until 0.051: lands 0.071;
    # B's at 0.051, stage 1 from 0.071: lands 0.091. A step lands every 20 ms.
    alone = simulate([(4, 2)], [0.0], StagedCost((0.010, 0.020), send=0.001))
    assert alone.results[0].token_times == pytest.approx([0.031, 0.062])
    run = simulate([(4, 2), (4, 2)], [0.0, 0.0], StagedCost((0.010, 0.020), send=0.001))
    a, b = run.results
    assert a.token_times == pytest.approx([0.031, 0.071])
    assert b.token_times == pytest.approx([0.051, 0.091])


class Watched(Simulation):
    """Checks, at every step it sends, that none of its requests is in a step still in flight."""

    most_in_flight = 0

    def sample(self, out: SchedulerOutput) -> RunnerOutput:
        flying = {rid for f in self.pipeline.flights for rid in f.out.num_scheduled_tokens}
        assert not flying & set(out.num_scheduled_tokens), "a request scheduled while in flight"
        Watched.most_in_flight = max(Watched.most_in_flight, len(self.pipeline.flights) + 1)
        return super().sample(out)


@pytest.mark.parametrize("stages", [2, 3])
def test_no_request_is_scheduled_while_its_step_is_in_flight(stages):
    # Mixed prompts and outputs arriving over time, chunked prompts, and a pool small enough
    # to preempt: every request still finishes, and the pipeline was kept full.
    Watched.most_in_flight = 0
    lengths = [(4 + 5 * (i % 4), 3 + 2 * (i % 5)) for i in range(12)]
    arrivals = [0.004 * i for i in range(12)]
    run = simulate(lengths, arrivals, StagedCost((0.01,) * stages), sim=Watched, blocks=20,
                   max_num_batched_tokens=8)
    assert all(r.success and r.output_len == o for r, (_, o) in zip(run.results, lengths))
    assert Watched.most_in_flight == stages
    assert run.step_summary()["preemptions"] > 0


def test_disaggregated_pools_of_two_stages_each():
    # Both pools 2 stages of 10 ms, hand-offs of 5 ms; A and B (8 prompt, 3 out) at 0.
    # Prefill: A lands at 0.02 (A1), B, sent at 0.01, at 0.03 (B1). Decode: A's KV at 0.025,
    # A2 lands 0.045; B's KV at 0.035, sent beside A's step, B2 lands 0.055; A3 0.065, B3 0.075.
    def pool() -> Simulation:
        return Simulation(SimSetup(SchedulerConfig(), CacheConfig(block_size=4), 64), StagedCost((0.01, 0.01)))

    run = DisaggregatedSimulation(pool(), pool(), lambda tokens: 0.005).run(workload((8, 3), (8, 3)), [0.0, 0.0])
    a, b = run.results
    assert a.token_times == pytest.approx([0.02, 0.045, 0.065])
    assert b.token_times == pytest.approx([0.03, 0.055, 0.075])
    assert run.duration_s == pytest.approx(0.075)


def test_the_roofline_times_each_stage():
    # 4 layers over 3 stages: 2, 1, 1 (as the engine splits them); the host's work on the
    # first, the LM head on the last, and a send of the activations between two.
    shape = ModelShape(hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4, num_kv_heads=4,
                       head_dim=64, vocab_size=32000)
    hw = Hardware("test", peak_flops=1e12, memory_bandwidth=1e11, memory_bytes=1e10, step_overhead=0.001,
                  interconnect_bandwidth=1e9, interconnect_latency=1e-5)
    step = StepShape(decode_tokens=8, decode_context=800, num_requests=8)
    whole = RooflineCostModel(shape, hw)
    staged = RooflineCostModel(shape, hw, pipeline_parallel=3)
    assert pipeline_stages(staged) == 3 and pipeline_stages(whole) == 1
    t = staged.stage_times(step)
    assert sum(t.stages) == pytest.approx(whole.step_seconds(step))
    assert t.stages[0] - 0.001 == pytest.approx(2 * t.stages[1])
    assert t.stages[2] > t.stages[1]
    assert t.send == pytest.approx(1e-5 + 8 * 256 * 2 / 1e9)
    assert staged.step_seconds(step) == pytest.approx(sum(t.stages) + 2 * t.send)


def test_a_fitted_model_is_not_split_into_stages(tmp_path, capsys):
    assert pipeline_stages(LinearCostModel.constant(0.01)) == 1
    cost = tmp_path / "cost.json"
    LinearCostModel.constant(0.01).save(cost)
    assert main(["simulate", "--model", "dummy:tiny", "--cost-model", str(cost), "--pipeline-stages", "2"]) == 2
    assert "--pipeline-stages needs a roofline" in capsys.readouterr().err
    # The engine's own setting would be ignored by the roofline: it is refused, not dropped.
    assert main(["simulate", "--model", "dummy:tiny", "--hardware", "zen3-avx2-2core", "-pp", "2"]) == 2
    assert "give the stages as --pipeline-stages" in capsys.readouterr().err
