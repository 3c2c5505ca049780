"""The fitted cost model's terms for what a light load's steps do: the kernel switch the
engine names (streamed weights up to a few rows, the GEMM past them), the first step of a row
count (the GEMM library makes its kernels then), steps held up by other work; and the file
format across versions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from travelator.model.linear_route import STREAMED_BF16_ROWS, STREAMED_QUANTIZED_ROWS
from travelator.sim.cost_model import (
    FORMAT_VERSION, RECENT_STEPS, LinearCostModel, ProfiledStep, StepHistory, StepShape, fit_linear,
    relative_errors,
)
from travelator.sim.profiling import LoopTimer, route_switch_rows

from test_cost_models import hand_timed

# A step of up to 2 rows streams its weights: 2.5 ms + 0.4 ms a row, 2.2 ms more right after a
# larger step, fading over the next ones (recovery 2 steps: the k-th after it pays
# exp(-(k - 1) / 2) of that). Past 2 rows the GEMM: 2.5 + 6 ms, and 0.05 ms a decode row. Beside
# that: 60 us a prompt token, 0.1 ms a request, 0.3 us a key read by a decode, 10 ns a causal
# pair; the first step after an idle spell 1 ms + 20 us a row more (fading alike), the first
# step of a row count 2 ms + 0.1 ms a row.
LIGHT = {"intercept": 2.5e-3, "large_step": 6e-3, "streamed_rows": 4e-4, "streamed_after_large": 2.2e-3,
         "decode_tokens": 5e-5, "prefill_tokens": 6e-5, "requests": 1e-4, "decode_context": 3e-7,
         "prefill_pairs": 1e-8, "after_idle": 1e-3, "after_idle_rows": 2e-5, "new_shape": 2e-3,
         "new_shape_rows": 1e-4}
SWITCH = 2
RECOVERY = 2.0


def light_load(n: int, noise: float, seed: int, coef=LIGHT, switch: int = SWITCH) -> list[ProfiledStep]:
    """A light load's steps: decodes of 1 to 16 rows over short and long contexts, and prompts
    of 32 to 1024 tokens, alone or beside a few decodes, each length coming up about twice,
    one step in ten after an idle spell; timed by hand (``hand_timed``) with relative noise."""
    rng = np.random.default_rng(seed)
    history = StepHistory()
    lengths = [int(x) for x in rng.integers(32, 1024, n // 6)]
    steps = []
    for _ in range(n):
        d = int(rng.choice([1, 1, 1, 2, 2, 3, 4, 6, 8, 12, 16]))
        if rng.random() < 0.25:
            p, d = int(rng.choice(lengths)), int(rng.integers(0, 4))
            shape = StepShape(p, d, d * int(rng.integers(32, 1024)), p * (p + 1) // 2, d + 1)
        else:
            shape = StepShape(0, d, d * int(rng.integers(32, 1024)), 0, d)
        shape = history.mark(shape, idle_s=0.5 if rng.random() < 0.1 else 0.0)
        seconds = hand_timed(coef, switch, shape, RECOVERY) * (1 + noise * rng.standard_normal())
        steps.append(ProfiledStep(shape, seconds))
    return steps


def test_the_fit_recovers_the_kernel_switch_the_engine_names():
    steps = light_load(600, noise=0.02, seed=1)
    fitted = fit_linear(steps[:450], switch_rows=(SWITCH,))
    assert fitted.large_step_rows == SWITCH and fitted.recovery_steps == RECOVERY
    for name in ("intercept", "large_step", "streamed_rows", "streamed_after_large", "prefill_tokens",
                 "new_shape_rows"):
        assert fitted.coefficients[name] == pytest.approx(LIGHT[name], rel=0.15), name
    # By hand: 2 rows over 600 keys stream: 2.5 + 2 x 0.4 + 2 x 0.05 + 2 x 0.1 + 600 x 0.0003
    # = 3.78 ms; right after a 3-row step 2.2 ms more, 5.98 ms; a step later 2.2 exp(-1/2)
    # = 1.334 ms more, 5.114 ms. 3 rows over 900 keys take the GEMM: 2.5 + 6 + 3 x 0.05
    # + 3 x 0.1 + 0.27 = 9.22 ms.
    two = StepShape(0, 2, 600, 0, 2, recent_rows=(2, 2))
    two_after_three, two_later = (StepShape(0, 2, 600, 0, 2, recent_rows=r) for r in ((3, 2), (2, 3)))
    three = StepShape(0, 3, 900, 0, 3, recent_rows=(2,))
    for shape, by_hand in ((two, 3.78e-3), (two_after_three, 5.98e-3), (two_later, 5.114e-3), (three, 9.22e-3)):
        assert hand_timed(LIGHT, SWITCH, shape, RECOVERY) == pytest.approx(by_hand, rel=1e-3)
        assert fitted.step_seconds(shape) == pytest.approx(by_hand, rel=0.05)
    assert np.median(relative_errors(fitted, steps[450:])) < 0.03


def test_the_first_steps_after_an_idle_spell_cost_more():
    steps = light_load(600, noise=0.01, seed=7)
    fitted = fit_linear(steps, switch_rows=(SWITCH,))
    # A 300-token prompt right after idle time: 1 + 300 x 0.02 = 7 ms more; the step after
    # it exp(-1/2) of that, 4.25 ms.
    prompt = StepShape(300, 0, 0, 45150, 1, recent_rows=(1,))
    after_idle, next_one = (StepShape(300, 0, 0, 45150, 1, recent_rows=(1,), since_idle=k) for k in (1, 2))
    assert fitted.step_seconds(after_idle) - fitted.step_seconds(prompt) == pytest.approx(7e-3, rel=0.1)
    assert fitted.step_seconds(next_one) - fitted.step_seconds(prompt) == pytest.approx(4.25e-3, rel=0.1)


def test_without_the_engine_s_word_the_fit_finds_the_switch_itself():
    # The engine names no switch (no native kernels): the candidates are tried, 4 wins.
    steps = light_load(600, noise=0.02, seed=2, switch=4)
    fitted = fit_linear(steps)
    assert fitted.large_step_rows == 4 and fitted.recovery_steps == RECOVERY
    assert fitted.coefficients["streamed_rows"] == pytest.approx(LIGHT["streamed_rows"], rel=0.2)


def test_a_switch_at_the_wrong_rows_misprices_the_few_row_steps():
    # The switch this fit once assumed (4 rows) on an engine that switches at 2: its 3- and
    # 4-row steps are priced as streamed ones (with a steeper cost a row to come near), one in
    # ten of them a sixth off or more.
    steps = light_load(600, noise=0.0, seed=3)
    few = [s for s in steps if s.shape.rows in (3, 4) and not s.shape.prefill_tokens]
    named = fit_linear(steps, switch_rows=(SWITCH,))
    assumed = fit_linear(steps, switch_rows=(4,))
    assert np.median(relative_errors(named, few)) < 0.01
    assert np.median(relative_errors(assumed, few)) > 0.04
    assert np.percentile(relative_errors(assumed, few), 90) > 0.15


def test_the_first_step_of_a_row_count_costs_its_kernels():
    steps = light_load(600, noise=0.01, seed=4)
    assert 50 < sum(s.shape.new_rows for s in steps) < 300
    fitted = fit_linear(steps, switch_rows=(SWITCH,))
    # A 500-token prompt, first of its length, then again: 2 + 50 ms apart.
    first, again = StepShape(500, 0, 0, 125250, 1, new_rows=True), StepShape(500, 0, 0, 125250, 1)
    assert hand_timed(LIGHT, SWITCH, first) - hand_timed(LIGHT, SWITCH, again) == pytest.approx(52e-3)
    assert fitted.step_seconds(first) - fitted.step_seconds(again) == pytest.approx(52e-3, rel=0.05)


def test_the_history_marks_new_row_counts_the_steps_before_and_idle_spells():
    history = StepHistory([3], recent_rows=[7])
    shapes = [history.mark(StepShape(0, d, 10 * d, 0, d), idle_s=idle)
              for d, idle in ((3, 0.0), (4, 0.0), (4, 1.0), (5, 0.001), (3, 0.0))]
    assert [s.new_rows for s in shapes] == [False, True, False, True, False]
    assert [s.recent_rows for s in shapes] == [(7,), (3, 7), (4, 3, 7), (4, 4, 3, 7), (5, 4, 4, 3, 7)]
    assert [s.since_idle for s in shapes] == [0, 0, 1, 2, 3]
    assert history.seen == {3, 4, 5}
    for _ in range(2 * RECENT_STEPS):
        history.mark(StepShape(0, 1, 1, 0, 1))
    assert history.recent_rows == (1,) * RECENT_STEPS


def test_steps_held_up_by_other_work_are_dropped_from_the_fit():
    steps = light_load(600, noise=0.02, seed=5)
    rng = np.random.default_rng(6)
    held_up = set(int(i) for i in rng.choice(len(steps), 20, replace=False))
    disturbed = [ProfiledStep(s.shape, s.seconds * (20.0 if i in held_up else 1.0)) for i, s in enumerate(steps)]
    fitted = fit_linear(disturbed, switch_rows=(SWITCH,))
    assert fitted.info["disturbed_steps_dropped"] == 20
    assert np.median(relative_errors(fitted, steps)) < 0.03


def test_a_held_up_step_does_not_bend_the_history_s_terms():
    # Held up 20x, one in five of the steps right after a prompt or an idle spell, on steps
    # timed 10% apart: a first fit with the fading terms bends them to explain those steps
    # (the after-idle term five times its size, fading within the step), keeps them, and so
    # keeps the bend. The held-up steps are found by a fit of the shape alone.
    steps = light_load(600, noise=0.1, seed=8)
    marked = [i for i, s in enumerate(steps) if s.shape.since_idle == 1
              or (s.shape.rows <= SWITCH and s.shape.recent_rows[:1] > (SWITCH,))]
    held_up = set(marked[::5])
    disturbed = [ProfiledStep(s.shape, s.seconds * (20.0 if i in held_up else 1.0)) for i, s in enumerate(steps)]
    fitted = fit_linear(disturbed, switch_rows=(SWITCH,))
    assert fitted.info["disturbed_steps_dropped"] == len(held_up) > 20
    assert fitted.recovery_steps == RECOVERY
    for name in ("streamed_after_large", "after_idle", "after_idle_rows"):
        assert fitted.coefficients[name] == pytest.approx(LIGHT[name], rel=0.25), name


def test_route_switch_rows_reads_the_engine_s_start_up_line():
    line = ("model m (llama, 56.4M parameters): bfloat16 on cpu, native kernels: linear layers 33 oneDNN bf16 "
            f"GEMM; {STREAMED_BF16_ROWS.format(rows=2)}; attention native; KV cache bfloat16")
    assert route_switch_rows(line) == (2,)
    quantized = f"{line}; {STREAMED_QUANTIZED_ROWS.format(rows=16)}, more are dequantized"
    assert route_switch_rows(quantized) == (2, 16)
    assert route_switch_rows("float16 on cuda, torch kernels: linear layers 33 F.linear") == ()


def test_a_format_1_file_loads_and_predicts_as_it_did(tmp_path):
    # Written before the version field, the streamed and first-step terms, and new_rows in
    # the profile's rows.
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"kind": "linear", "coefficients": {"intercept": 0.01, "large_step": 0.005,
                                                                   "decode_tokens": 0.001},
                                "large_step_rows": 4, "info": {"profile": [[0, 8, 80, 0, 8, 0.02]]}}))
    old = LinearCostModel.load(path)
    assert old.step_seconds(StepShape(decode_tokens=8, num_requests=8, new_rows=True)) == pytest.approx(0.023)
    assert old.step_seconds(StepShape(decode_tokens=4, num_requests=4)) == pytest.approx(0.014)
    step = ProfiledStep.from_row(old.info["profile"][0])
    assert step == ProfiledStep(StepShape(0, 8, 80, 0, 8, False), 0.02)
    marked = ProfiledStep(StepShape(0, 8, 80, 0, 8, True, (3, 600), 2), 0.02)
    assert ProfiledStep.from_row(json.loads(json.dumps(marked.to_row()))) == marked
    old.save(tmp_path / "new.json")
    assert json.loads((tmp_path / "new.json").read_text())["version"] == FORMAT_VERSION
    assert LinearCostModel.load(tmp_path / "new.json").coefficients == old.coefficients
    path.write_text(json.dumps({"kind": "linear", "version": FORMAT_VERSION + 1, "coefficients": {}}))
    with pytest.raises(ValueError, match="newer than"):
        LinearCostModel.load(path)


class FakeEngine:
    """What LoopTimer reads of an engine, set by the test between steps."""

    def __init__(self) -> None:
        self.last_schedule = None
        self.last_step = None
        self.unfinished = True

    def has_unfinished_requests(self) -> bool:
        return self.unfinished

    def seconds_until_admission(self) -> None:
        return None


def test_the_loop_timer_counts_the_loop_s_work_between_busy_steps(monkeypatch):
    # Steps of 4 ms ending at 10, 15 and 20 ms (1 ms of loop work each time), then the
    # engine idles; the next step (4 ms) ends at 100 ms: its own 4 ms + the median 1 ms, the
    # first after an idle spell.
    from types import SimpleNamespace

    import travelator.sim.profiling as profiling

    engine, clock = FakeEngine(), iter([0.0, 0.010, 0.015, 0.020, 0.100])
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(profiling.StepShape, "of", staticmethod(lambda out: StepShape(0, 1, 10, 0, 1)))
    timer = LoopTimer(engine, StepHistory())
    for unfinished in (True, True, False, True):
        engine.last_step = SimpleNamespace(duration_s=0.004)
        engine.unfinished = unfinished
        timer()
    assert [s.seconds for s in timer.steps()] == pytest.approx([0.005, 0.005, 0.005, 0.005])
    assert [s.shape.new_rows for s in timer.steps()] == [True, False, False, False]
    assert [s.shape.since_idle for s in timer.steps()] == [0, 0, 0, 1]
