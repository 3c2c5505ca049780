"""The KV pool sized like a GPU server's (engine/kv_sizing.py, engine/kv_profile.py): the
arithmetic over given numbers, the start-up profile's control flow over fake memory numbers
(on the CPU), and the real profile on a CUDA device."""

from __future__ import annotations

import pytest
import torch

from travelator import LLM
from travelator.config import CacheConfig
from travelator.engine import engine as engine_module
from travelator.engine.kv_profile import LargestStep, dummy_step, profile_memory
from travelator.engine.kv_sizing import MemoryProfile, kv_pool_blocks, kv_pool_bytes
from travelator.engine.scheduler_output import RunnerOutput
from travelator.sampling_params import SamplingParams

GIB = 1 << 30
MIB = 1 << 20


# ---- the arithmetic ----------------------------------------------------------------------
def test_pool_is_the_share_less_what_is_in_use_and_the_peak():
    profile = MemoryProfile(total=80 * GIB, in_use=16 * GIB, activation_peak=2 * GIB)
    assert kv_pool_bytes(0.9, profile) == 72 * GIB - 18 * GIB
    assert kv_pool_bytes(1.0, profile) == 62 * GIB
    # 54 GiB in blocks of 2 MiB
    assert kv_pool_blocks(0.9, profile, bytes_per_block=2 * MIB, block_size=16, max_model_len=4096) == 54 * 512


def test_blocks_round_down_and_must_hold_one_full_context():
    profile = MemoryProfile(total=10 * GIB, in_use=8 * GIB, activation_peak=GIB)
    budget = kv_pool_bytes(1.0, profile)
    assert kv_pool_blocks(1.0, profile, budget // 7 + 1, block_size=16, max_model_len=16 * 6) == 6
    with pytest.raises(ValueError) as e:
        kv_pool_blocks(1.0, profile, budget // 7 + 1, block_size=16, max_model_len=16 * 7 + 1)
    message = str(e.value)
    for words in ("gpu_memory_utilization 1.0 of 10.00 GiB", "8.00 GiB in use", "peak of 1.00 GiB",
                  "leaves 1.00 GiB", "max_model_len 113", "raise gpu_memory_utilization",
                  "lower max_model_len", "max_num_batched_tokens"):
        assert words in message


def test_no_room_at_all_is_the_same_clear_error():
    profile = MemoryProfile(total=10 * GIB, in_use=9 * GIB, activation_peak=2 * GIB)
    assert kv_pool_bytes(0.9, profile) < 0
    with pytest.raises(ValueError, match="leaves -2.00 GiB"):
        kv_pool_blocks(0.9, profile, MIB, block_size=16, max_model_len=16)


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_is_a_share(share):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        CacheConfig(gpu_memory_utilization=share).validate()
    CacheConfig(gpu_memory_utilization=1.0).validate()


# ---- the dummy step ----------------------------------------------------------------------
@pytest.mark.parametrize("tokens, seqs, max_len, lengths", [
    (1024, 128, 2048, [8] * 128),
    (10, 3, 2048, [4, 3, 3]),
    (5, 128, 2048, [1] * 5),
    (100, 2, 20, [19, 19]),  # no prompt longer than a context leaves for its first token
])
def test_dummy_step_spreads_the_token_budget_over_the_requests(tokens, seqs, max_len, lengths):
    out, num_blocks = dummy_step(LargestStep(tokens, seqs, max_len, block_size=4))
    assert list(out.num_scheduled_tokens.values()) == lengths
    assert [len(r.prompt_token_ids) for r in out.new_requests] == lengths
    blocks = [b for r in out.new_requests for b in r.block_ids]
    assert sorted(blocks) == list(range(num_blocks))  # each request on blocks of its own
    assert all(len(r.block_ids) == -(-len(r.prompt_token_ids) // 4) for r in out.new_requests)
    assert out.num_prefill_tokens == sum(lengths)


# ---- the profile's control flow, on fake numbers -----------------------------------------
class FakeStats:
    """A device whose tensors take ``step_bytes`` more during a step; everything is logged."""

    def __init__(self, log: list, total=80 * GIB, in_use=(10 * GIB, 10 * GIB), step_bytes=3 * GIB):
        self.log, self._total, self._in_use, self.step_bytes = log, total, list(in_use), step_bytes
        self.base, self.stepping = 5 * GIB, False

    def total(self):
        return self._total

    def in_use(self):
        self.log.append("in_use")
        return self._in_use.pop(0)

    def release_cached(self):
        self.log.append("release_cached")

    def reset_peak(self):
        self.log.append("reset_peak")

    def allocated(self):
        return self.base

    def peak_allocated(self):
        self.log.append("peak_allocated")
        return self.base + self.step_bytes


class FakeRunner:
    def __init__(self, log: list) -> None:
        self.log, self.held = log, set()

    def allocate_kv_cache(self, num_blocks, block_size):
        self.log.append(("allocate", num_blocks))

    def execute(self, out):
        self.held |= {r.request_id for r in out.new_requests}
        self.held -= set(out.freed_request_ids)
        self.log.append(("execute", len(out.num_scheduled_tokens), len(out.freed_request_ids)))
        if out.new_requests and self.fail:
            raise RuntimeError("out of memory")
        return RunnerOutput()

    fail = False


def test_profile_measures_in_use_before_the_step_and_its_peak_over_what_was_allocated():
    log: list = []
    runner = FakeRunner(log)
    step = LargestStep(num_tokens=64, num_seqs=4, max_model_len=128, block_size=16)
    profile = profile_memory(runner, FakeStats(log), step)
    assert profile == MemoryProfile(total=80 * GIB, in_use=10 * GIB, activation_peak=3 * GIB)
    assert log == [
        "release_cached", "in_use",  # after the weights, with the loader's buffers given back
        ("allocate", 4),  # a scratch pool for the dummy step's 4 requests of 16 tokens
        "reset_peak", ("execute", 4, 0), ("execute", 0, 4),  # the step, then its requests freed
        "peak_allocated", ("allocate", 0), "release_cached", "in_use",
    ]
    assert not runner.held


def test_what_the_step_leaves_in_use_counts_as_in_use():
    log: list = []
    stats = FakeStats(log, in_use=(10 * GIB, 11 * GIB))
    profile = profile_memory(FakeRunner(log), stats, LargestStep(64, 4, 128, 16))
    assert profile.in_use == 11 * GIB


def test_a_failed_dummy_step_still_frees_its_requests():
    log: list = []
    runner = FakeRunner(log)
    runner.fail = True
    with pytest.raises(RuntimeError, match="out of memory"):
        profile_memory(runner, FakeStats(log), LargestStep(64, 4, 128, 16))
    assert not runner.held


# ---- the engine, through the seam --------------------------------------------------------
def _engine_with_fake_device(monkeypatch, **kwargs):
    """An engine on the CPU, sized as on a GPU whose numbers FakeStats makes up: the real
    runner runs the dummy step."""
    log: list = []
    stats = FakeStats(log, total=GIB, in_use=(GIB // 4, GIB // 4), step_bytes=GIB // 8)
    monkeypatch.setattr(engine_module, "device_memory_stats", lambda device: stats)
    llm = LLM("dummy:tiny", device="cpu", kernels="torch", dtype="float32", max_model_len=256, **kwargs)
    return llm, log


def test_engine_sizes_the_pool_from_the_profile(monkeypatch):
    llm, log = _engine_with_fake_device(monkeypatch, gpu_memory_utilization=0.5,
                                        max_num_seqs=8, max_num_batched_tokens=64)
    engine = llm.engine
    assert engine.memory_profile == MemoryProfile(GIB, GIB // 4, GIB // 8)
    per_block = engine.runner.kv_bytes_per_block(16)
    assert engine.kv.num_blocks == (GIB // 2 - GIB // 4 - GIB // 8) // per_block
    assert "reset_peak" in log and not engine.runner.held_request_ids()  # the dummies are gone
    out = llm.generate(["once upon"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("explicit", [{"num_kv_blocks": 40}, {"kv_cache_bytes": 1 << 20}])
def test_explicit_sizes_win_and_nothing_is_profiled(monkeypatch, explicit):
    llm, log = _engine_with_fake_device(monkeypatch, **explicit)
    assert log == [] and llm.engine.memory_profile is None
    per_block = llm.engine.runner.kv_bytes_per_block(16)
    assert llm.engine.kv.num_blocks == explicit.get("num_kv_blocks", (1 << 20) // per_block)


def test_engine_refuses_a_pool_without_one_full_context(monkeypatch):
    with pytest.raises(ValueError, match="does not hold one full context"):
        _engine_with_fake_device(monkeypatch, gpu_memory_utilization=0.375)


# ---- the real thing ----------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_profile_keeps_the_engine_within_its_share():
    utilization = 0.5
    llm = LLM("dummy:llama-50m", device="cuda", gpu_memory_utilization=utilization,
              max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=1024)
    profile = llm.engine.memory_profile
    assert profile is not None and profile.activation_peak > 0
    assert profile.in_use >= llm.engine.runner.model.weight_bytes()
    prompts = [[7] * 60] * 32  # the largest step the scheduler forms: the token budget, full
    llm.generate(prompts, SamplingParams(max_tokens=8, top_p=0.9), use_tqdm=False)
    free, total = torch.cuda.mem_get_info()
    assert total - free <= utilization * total + 256 * MIB  # allowing the allocator's rounding


def test_a_cpu_pool_takes_its_share_of_the_memory_a_container_leaves(monkeypatch):
    """Unsized, the CPU pool takes kv_memory_share of what new allocations can take
    (model/host_memory.available_bytes: MemAvailable, or a memory cgroup's room where less)."""
    from travelator.engine import engine as engine_module

    room = 64 << 20
    monkeypatch.setattr(engine_module, "available_bytes", lambda: room)
    llm = LLM("dummy:tiny", device="cpu", kernels="torch", dtype="float32", max_model_len=256, max_num_seqs=256,
              kv_memory_share=0.25)
    per_block = llm.engine.runner.kv_bytes_per_block(16)
    assert llm.engine.kv.num_blocks == (room // 4) // per_block < 256 * 256 // 16
