"""The step-cost models: the roofline against arithmetic done by hand, the fitted model
recovering known coefficients, and saving and loading."""

from __future__ import annotations

import math

import numpy as np
import pytest

from travelator.model.arch import PRESETS
from travelator.sim.cost_model import LinearCostModel, ProfiledStep, StepShape, fit_linear, relative_errors
from travelator.sim.roofline import Hardware, ModelShape, RooflineCostModel, known_hardware

TINY = ModelShape(hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4,
                  vocab_size=10, gated_mlp=False)
UNIT = Hardware("unit", peak_flops=1e9, memory_bandwidth=1e9, memory_bytes=1e6,
                compute_efficiency=1.0, memory_efficiency=1.0)


def test_roofline_of_one_decode_by_hand():
    # One decode over 4 keys, 2-byte numbers, FLOP/s = bytes/s = 1e9, so each operator costs
    # max(2nk, 2(nk + n + k)) ns = 2(nk + n + k) ns (the weights dominate):
    # qkv (12x4) 128, o (4x4) 48, up (8x4) 88, down (4x8) 88; attention: 4*4 FLOP per key pair
    # = 64, keys read 4 * 16 bytes = 64; LM head (10x4) 108. Total 524 ns.
    cost = RooflineCostModel(TINY, UNIT)
    assert cost.step_seconds(StepShape(decode_tokens=1, decode_context=4, num_requests=1)) == pytest.approx(524e-9)


def test_roofline_of_a_7b_decode_is_the_weight_read():
    # Batch 1 on an A100 is memory bound: about the bf16 weights (6.7e9 parameters, 2 bytes)
    # over the bandwidth, plus the per-step overhead.
    llama7b = ModelShape(4096, 11008, 32, 32, 32, 128, 32000)
    a100 = Hardware.load("a100-sxm-80gb")
    expected = llama7b.weight_bytes / (a100.memory_bandwidth * a100.memory_efficiency) + a100.step_overhead
    assert 13.4e9 < llama7b.weight_bytes < 13.6e9
    got = RooflineCostModel(llama7b, a100).step_seconds(StepShape(decode_tokens=1, decode_context=512, num_requests=1))
    assert got == pytest.approx(expected, rel=0.02)
    # A 4096-token prefill is compute bound: 2 FLOP per parameter and token at the peak.
    prefill = RooflineCostModel(llama7b, a100).step_seconds(
        StepShape(prefill_tokens=4096, prefill_pairs=4096 * 4097 // 2, num_requests=1))
    dense = 2 * 4096 * (llama7b.weight_bytes / 2 - 2 * 32000 * 4096) / (a100.peak_flops * a100.compute_efficiency)
    assert dense < prefill < 1.3 * dense


def test_tensor_parallel_splits_the_work_and_pays_for_all_reduces():
    llama7b = ModelShape(4096, 11008, 32, 32, 32, 128, 32000)
    a100 = Hardware.load("a100-sxm-80gb")
    decode = StepShape(decode_tokens=8, decode_context=8 * 512, num_requests=8)
    one, two = (RooflineCostModel(llama7b, a100, tensor_parallel=tp).step_seconds(decode) - a100.step_overhead
                for tp in (1, 2))
    # Half the weights per rank, plus two ring all-reduces per layer of 8 x 4096 bf16 numbers:
    # latency + 2 (tp - 1) / tp x bytes / link bandwidth each.
    all_reduces = 2 * 32 * (a100.interconnect_latency + 8 * 4096 * 2 / a100.interconnect_bandwidth)
    assert two == pytest.approx(one / 2 + all_reduces, rel=0.02)
    with pytest.raises(ValueError, match="no interconnect"):
        RooflineCostModel(TINY, UNIT, tensor_parallel=2).step_seconds(decode)


def test_hardware_descriptions_in_the_repo_load():
    assert {"a100-sxm-80gb", "h100-sxm-80gb", "zen3-avx2-2core"} <= set(known_hardware())
    for name in known_hardware():
        assert Hardware.load(name).peak_flops > 0
    with pytest.raises(ValueError, match="no hardware description"):
        Hardware.load("abacus")


def test_kv_blocks_are_what_the_weights_leave():
    shape = ModelShape.from_arch(PRESETS["llama-50m"])
    hw = Hardware("h", 1e12, 1e11, memory_bytes=2**30)
    free = 2**30 * 0.9 - shape.weight_bytes
    assert RooflineCostModel(shape, hw).kv_blocks(16) == int(free // (shape.kv_bytes_per_token * 16))


def synthetic_steps(coef: dict[str, float], large_rows: int, n: int, noise: float, seed: int,
                    max_chunks: int = 1, max_decodes: int = 40, max_chunk: int = 512):
    """Steps of up to ``max_decodes`` decodes beside up to ``max_chunks`` prompt chunks (a
    loaded run's mix), timed by the known coefficients (summed here by hand, not by the model under test)."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(n):
        d = int(rng.integers(0, max_decodes))
        chunks = [int(rng.integers(1, max_chunk)) for _ in range(int(rng.integers(0, max_chunks + 1)))]
        if rng.random() < 0.5:
            chunks = chunks[:1] if rng.random() < 0.5 else []
        p = sum(chunks)
        shape = StepShape(p, d, d * int(rng.integers(16, 1024)), sum(c * c // 2 for c in chunks), d + len(chunks))
        if shape.prefill_tokens + shape.decode_tokens == 0:
            continue
        steps.append(ProfiledStep(shape, hand_timed(coef, large_rows, shape) * (1 + noise * rng.standard_normal())))
    return steps


def hand_timed(coef: dict[str, float], large_rows: int, s: StepShape, recovery: float = 1.0) -> float:
    rows = s.prefill_tokens + s.decode_tokens
    since_large = next((k + 1 for k, r in enumerate(s.recent_rows) if r > large_rows), 0)
    after_large = math.exp(-(since_large - 1) / recovery) if since_large and rows <= large_rows else 0.0
    after_idle = math.exp(-(s.since_idle - 1) / recovery) if s.since_idle else 0.0
    return (coef.get("intercept", 0) + coef.get("large_step", 0) * (rows > large_rows)
            + coef.get("streamed_rows", 0) * rows * (rows <= large_rows)
            + coef.get("streamed_after_large", 0) * after_large
            + (coef.get("after_idle", 0) + coef.get("after_idle_rows", 0) * rows) * after_idle
            + coef.get("prefill_tokens", 0) * s.prefill_tokens + coef.get("decode_tokens", 0) * s.decode_tokens
            + coef.get("requests", 0) * s.num_requests + coef.get("decode_context", 0) * s.decode_context
            + coef.get("prefill_pairs", 0) * s.prefill_pairs
            + (coef.get("new_shape", 0) + coef.get("new_shape_rows", 0) * rows) * s.new_rows)


def test_the_fit_recovers_known_coefficients_and_the_kernel_switch():
    coef = {"intercept": 0.004, "large_step": 0.006, "prefill_tokens": 2e-4, "decode_tokens": 1e-4,
            "requests": 2e-3, "decode_context": 1e-7, "prefill_pairs": 1e-8}
    steps = synthetic_steps(coef, 4, 400, noise=0.02, seed=1, max_chunks=3)
    fitted = fit_linear(steps[:300])
    assert fitted.large_step_rows == 4
    for name, value in coef.items():
        if name in ("prefill_pairs", "decode_tokens"):
            continue  # a small share of any step's time: the data pin them down loosely
        # Keys read are a few percent of a decode step's time: pinned down less tightly.
        assert fitted.coefficients[name] == pytest.approx(value, rel=0.25 if name == "decode_context" else 0.15), name
    # A decode's row and its request always come together: their sum is what the data fix.
    decode = fitted.coefficients["decode_tokens"] + fitted.coefficients["requests"]
    assert decode == pytest.approx(coef["decode_tokens"] + coef["requests"], rel=0.05)
    held = steps[300:]
    assert np.median(relative_errors(fitted, held)) < 0.03


def test_the_fit_is_not_biased_on_steps_that_mix_prompts_and_decodes():
    # Each request costs its row of logits and its sampling, whether it decodes or ends a
    # prompt chunk (a small model's LM head is a large share of its weights). Fitted on a
    # profile of steps with at most one prompt chunk, the model must predict a loaded run's
    # steps: several short prompts beside decodes.
    coef = {"intercept": 0.004, "large_step": 0.002, "prefill_tokens": 2e-4, "decode_tokens": 2e-4,
            "requests": 4e-3, "decode_context": 1e-7}
    profile = synthetic_steps(coef, 4, 300, noise=0.05, seed=3)
    loaded = synthetic_steps(coef, 4, 300, noise=0.0, seed=4, max_chunks=4, max_decodes=16, max_chunk=128)
    mixed = [s for s in loaded if s.shape.decode_tokens and s.shape.num_requests - s.shape.decode_tokens > 1]
    assert len(mixed) > 50
    fitted = fit_linear(profile)
    predicted = sum(fitted.step_seconds(s.shape) for s in mixed)
    assert predicted == pytest.approx(sum(s.seconds for s in mixed), rel=0.03)
    assert np.median(relative_errors(fitted, mixed)) < 0.03


def test_saved_and_loaded_models_predict_alike(tmp_path):
    model = LinearCostModel({"intercept": 0.01, "large_step": 0.005, "decode_tokens": 0.001}, 4, {"model": "m"})
    model.save(tmp_path / "c.json")
    again = LinearCostModel.load(tmp_path / "c.json")
    shape = StepShape(decode_tokens=8, num_requests=8)
    assert again.step_seconds(shape) == model.step_seconds(shape) == pytest.approx(0.023)  # 8 rows > 4
    small = StepShape(decode_tokens=4, num_requests=4)
    assert again.step_seconds(small) == pytest.approx(0.014)
    with pytest.raises(ValueError, match="unknown cost features"):
        LinearCostModel({"flops": 1.0})


def test_all_reduce_time_is_a_ring_over_the_link():
    # Arithmetic and memory free, a link of 1e9 bytes/s: a step costs its two all-reduces per
    # layer, each 2 (tp - 1) / tp of the activations (8 rows x 4 numbers x 2 bytes = 64 bytes):
    # TP=4: 2 x 1.5 x 64 = 192 ns.
    link = Hardware("link", peak_flops=1e30, memory_bandwidth=1e30, memory_bytes=1e6, interconnect_bandwidth=1e9)
    step = StepShape(decode_tokens=8, decode_context=64, num_requests=8)
    assert RooflineCostModel(TINY, link, tensor_parallel=4).step_seconds(step) == pytest.approx(192e-9)
    # Pipeline stages: one send of the activations between each pair (64 bytes, 64 ns).
    assert RooflineCostModel(TINY, link, pipeline_parallel=3).step_seconds(step) == pytest.approx(128e-9)


def test_steps_slowed_by_other_work_do_not_bias_the_fit_low():
    # On a shared machine some steps are delayed (here: a third of them run at half speed).
    # The fit should predict the time the steps took in all, not that of the lucky ones.
    coef = {"intercept": 0.004, "prefill_tokens": 2e-4, "decode_tokens": 1e-4}
    steps = synthetic_steps(coef, 4, 600, noise=0.0, seed=2)
    rng = np.random.default_rng(5)
    slowed = [ProfiledStep(s.shape, s.seconds * (2.0 if rng.random() < 1 / 3 else 1.0)) for s in steps]
    fitted = fit_linear(slowed)
    predicted = sum(fitted.step_seconds(s.shape) for s in slowed)
    assert predicted == pytest.approx(sum(s.seconds for s in slowed), rel=0.1)
