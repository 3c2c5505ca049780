"""Profiling the real engine for the fitted cost model: every step it ran is recorded with the
shape the simulator would give it. (The held-out error of a fit on real timings depends on the
machine's load; it is reported by travelator fit-step-cost, and checked on synthetic steps in
test_cost_models.py.)"""

from __future__ import annotations

import numpy as np

from travelator import LLM
from travelator.model.linear_route import LinearRoute
from travelator.sim.profiling import fit_and_check, profile_engine, profiling_plan, route_switch_rows


def test_profiled_steps_account_for_every_token_of_the_plan():
    engine = LLM("dummy:tiny", max_num_seqs=32, max_num_batched_tokens=1024).engine
    # No budget at all: the first pass still runs whole (a busy machine's profile has every
    # shape the fit needs), and no second one.
    steps = profile_engine(engine, budget_s=0.0, passes=2)
    plan = profiling_plan(engine.arch.vocab_size, engine.max_model_len)
    prompts = sum(r.prompt_len for w, _ in plan for r in w.requests)
    decodes = sum(r.output_len - 1 for w, _ in plan for r in w.requests)
    prefill = sum(s.shape.prefill_tokens for s in steps)
    assert prefill + sum(s.shape.decode_tokens for s in steps) == prompts + decodes
    # The scheduler counts a prompt's last chunk of one token as a decode (it costs like one):
    # at most one such token per request.
    num_requests = sum(len(w) for w, _ in plan)
    assert prompts - num_requests <= prefill <= prompts
    # Each decode reads its whole context: the keys of prompt and outputs so far.
    contexts = sum(sum(r.prompt_len + k for k in range(1, r.output_len)) for w, _ in plan for r in w.requests)
    assert contexts <= sum(s.shape.decode_context for s in steps) <= contexts + prompts
    assert all(s.seconds > 0 for s in steps)
    # Each row count's first step is marked, once (the warm-up's counts are no longer new).
    first = [s.shape.rows for s in steps if s.shape.new_rows]
    assert first and len(first) == len(set(first))
    # The kernel switch the fit takes is the one the engine's start-up line names: none where
    # every bf16 layer takes blocked_linear, which takes every row count.
    ops = engine.runner.ops
    route = getattr(ops, "linear_route", lambda _weight: None)  # NativeOps only
    switching = any(route(w) is not LinearRoute.BLOCKED for w in engine.runner.model.linear_weights())
    streamed = ops.streaming_rows(False) if switching else 0
    assert route_switch_rows(engine.summary) == ((streamed,) if streamed else ())
    model, check = fit_and_check(steps, route_switch_rows(engine.summary))
    assert check["held_out_steps"] == len(steps[::5])
    assert np.isfinite(check["held_out_median_rel_error"])
    assert all(v >= 0 for v in model.coefficients.values())
