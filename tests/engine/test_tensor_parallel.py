"""Tensor parallelism on CPU over gloo: TP=2 against TP=1 and transformers, per-rank
memory, and what happens when a worker or the driver dies.

Workers are real processes launched by the engine (one torch thread each here).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_models import (build_checkpoint, gemma3_overrides, gpt_oss_overrides, load_reference, mixtral_overrides,
                       mxfp4_checkpoint, phi3_overrides, qwen3_moe_overrides, randomize, reference_greedy)
from staggered import greedy, run_staggered
from tp_deadline import one_thread_per_worker_and_a_deadline
from travelator import LLM
from travelator.engine.tp_executor import TensorParallelError


@pytest.fixture(autouse=True)
def _one_thread_per_worker_and_a_deadline(monkeypatch):
    yield from one_thread_per_worker_and_a_deadline(monkeypatch, 60, "tensor-parallel test")


def make_requests(n: int, seed: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_tokens): staggered, prompts of 3 to 60 tokens."""
    rng = random.Random(seed)
    return [(rng.randint(0, 12), [1] + [rng.randrange(3, 300) for _ in range(rng.randint(3, 60))],
             rng.randint(1, 20)) for _ in range(n)]


# Chunked prefill (7-token budget) and preemption (12 blocks of 8 tokens for 10 requests
# of up to 61 + 20 tokens) in the same run.
TIGHT = dict(dtype="float32", block_size=8, num_kv_blocks=12, max_num_batched_tokens=7)


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory):
    """A family's checkpoint, its TP=1 run and transformers' tokens, made once per module: the
    expert-parallel test checks TP=2 against the same ones as the tensor-parallel test."""
    runs: dict[str, SimpleNamespace] = {}

    def run(family: str) -> SimpleNamespace:
        if family not in runs:
            runs[family] = _tp1_and_transformers(family, tmp_path_factory.mktemp(family))
        return runs[family]

    return run


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe", "gpt_oss"])
def test_tp2_matches_tp1_and_transformers(family, tp1_run):
    """Mixtures of experts: each rank holds half of every expert's intermediate size."""
    check_tp2_against_tp1_and_transformers(tp1_run(family))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_placed_experts_match_tp1_and_transformers(family, tp1_run):
    """Expert parallelism: each rank holds every other expert whole (and its bias) and runs
    only their pairs."""
    one, two, mem = check_tp2_against_tp1_and_transformers(tp1_run(family), expert_parallel=True)
    inter = one.engine.arch.expert_intermediate_size
    driver = two.engine.runner.runner.model  # rank 0's shard
    for layer in [layer for layer in driver.layers if hasattr(layer.mlp, "experts")]:
        held = [tuple(e.gate_up_weight.shape) for e in layer.mlp.experts]
        assert held[0::2] == [(2 * inter, one.engine.arch.hidden_size)] * len(held[0::2])  # whole
        assert set(held[1::2]) == {(0, 0)}  # rank 1's
    # The other weights are split in halves or replicated (norms, routers: a few KB).
    total = sum(p.numel() * p.element_size() for p in one.engine.runner.model.parameters())
    for m in mem:
        assert abs(m["weights"] - total / 2) < 0.05 * total, (m, total)


def test_placed_mxfp4_experts_stay_4_bit(tmp_path):
    """gpt-oss's MXFP4 experts, placed whole on their ranks, keep their blocks (no rank cuts
    them): the same tokens as one rank, which keeps them too."""
    from travelator.model.quant import Int4Weight

    path = mxfp4_checkpoint(tmp_path)
    prompts = [[1, 7, 99, 250, 3, 18, 42, 77], [1, 5, 6, 7, 8, 9]]
    one = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16)
    want = [r.token_ids for r in one.generate(prompts, greedy(8), use_tqdm=False)]
    two = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16, tensor_parallel_size=2,
              expert_parallel=True)
    try:
        got = [r.token_ids for r in two.generate(prompts, greedy(8), use_tqdm=False)]
    finally:
        two.shutdown()
    assert got == want
    experts = two.engine.runner.runner.model.layers[0].mlp.experts
    assert isinstance(experts[0].gate_up_weight, Int4Weight) and experts[0].gate_up_weight.codebook == "e2m1"
    assert experts[1].gate_up_weight.numel() == 0  # rank 1's


def _tp1_and_transformers(family: str, tmp_path: Path) -> SimpleNamespace:
    """Staggered requests through TP=1 (chunked and preempted), and transformers' greedy tokens
    for them, which TP=1's must be."""
    overrides = {"llama": {"tie_word_embeddings": True}, "qwen3": {"head_dim": 32},
                 "phi3": phi3_overrides(original=512, maximum=512),
                 "gemma3": gemma3_overrides(window=5), "mixtral": mixtral_overrides(),
                 "qwen3_moe": qwen3_moe_overrides(), "gpt_oss": gpt_oss_overrides()}.get(family, {})
    path = build_checkpoint(tmp_path, family, **overrides)
    if family == "gpt_oss":  # biases and sinks split over ranks or added once: make them count
        randomize(path, ("bias", "sinks"), 0.5)
    reqs = make_requests(10, seed=11)
    one = LLM(str(path), device="cpu", **TIGHT)
    want = run_staggered(one, reqs)
    assert one.engine.counters.preemptions > 0
    ref = load_reference(path)
    for i, (_, prompt, m) in enumerate(reqs):
        assert want[i] == reference_greedy(ref, prompt, m), f"request {i} differs"
    return SimpleNamespace(path=path, reqs=reqs, one=one, want=want)


def check_tp2_against_tp1_and_transformers(tp1: SimpleNamespace, **parallel):
    """The same staggered requests through TP=2 (with ``parallel`` settings): TP=1's tokens,
    which are transformers' greedy ones. Returns both LLMs (TP=2's shut down) and TP=2's
    memory by rank."""
    one = tp1.one
    two = LLM(str(tp1.path), device="cpu", tensor_parallel_size=2, **TIGHT, **parallel)
    try:
        got = run_staggered(two, tp1.reqs)
        assert two.engine.counters.preemptions == one.engine.counters.preemptions
        # Every rank holds its own share of the KV heads (2 KV heads: one each).
        mem = two.engine.runner.call("memory")
        kv_one = sum(k.numel() * k.element_size() * 2 for k, _ in one.engine.runner.kv_caches)
        assert [m["kv_cache"] for m in mem] == [kv_one // 2] * 2
    finally:
        two.shutdown()
    assert got == tp1.want
    return one, two, mem


def test_dummy_weights_same_model_and_half_the_weights_per_rank():
    prompts = [[1, 5, 6, 7, 8], [1] + list(range(100, 140))]
    one = LLM("dummy:tiny", device="cpu", dtype="float32", num_kv_blocks=16)
    two = LLM("dummy:tiny", device="cpu", dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    try:
        got = [r.token_ids for r in two.generate(prompts, greedy(10), use_tqdm=False)]
        per_rank = [m["weights"] for m in two.engine.runner.call("memory")]
        check_runner_states_on_every_rank(two)
    finally:
        two.shutdown()
    want = [r.token_ids for r in one.generate(prompts, greedy(10), use_tqdm=False)]
    assert got == want
    total = sum(p.numel() * p.element_size() for p in one.engine.runner.model.parameters())
    # Everything is split but the norms (a few hundred floats), so each rank holds ~half.
    for b in per_rank:
        assert 0.5 <= b / total < 0.51, (b, total)


def check_runner_states_on_every_rank(llm: LLM) -> None:
    """The self-check reads the request states of a tensor-parallel group too."""
    from travelator.engine.input_batch import RunnerRequestState
    from travelator.engine.self_check import engine_self_check
    from travelator.sampling_params import SamplingParams

    assert engine_self_check(llm.engine)["ok"]
    driver = llm.engine.runner.runner
    driver.batch.states["ghost"] = RunnerRequestState("ghost", 1, [1], SamplingParams(), [], 0)
    try:
        report = engine_self_check(llm.engine)
    finally:
        del driver.batch.states["ghost"]
    assert not report["ok"]
    assert "runner states of finished requests: ['ghost']" in report["problems"]


def test_shard_splits_fused_parts_and_pads_the_vocabulary():
    import torch

    from travelator.model.layers import Shard

    qkv = Shard(0, (4, 2, 2))  # q, k, v rows of a fused projection
    full = torch.arange(8.0)
    assert [qkv.shard(full, r, 2).tolist() for r in range(2)] == [[0, 1, 4, 6], [2, 3, 5, 7]]
    assert qkv.local_offset(1, 2) == 2 and qkv.piece(1, 2) == 1
    # q_proj alone, as it streams in from a checkpoint, lands in the same rows.
    assert qkv.take(full[:4], 0, 1, 2).tolist() == [2, 3]
    vocab = Shard(0, (5,))
    emb = torch.arange(10.0).view(5, 2)
    pieces = [vocab.shard(emb, r, 2) for r in range(2)]
    assert vocab.local_shape((5, 2), 2) == (3, 2)
    assert torch.equal(torch.cat(pieces)[:5], emb) and pieces[1][-1].eq(0).all()
    down = Shard(1, (4,))
    w = torch.arange(8.0).view(2, 4)
    assert torch.equal(torch.cat([down.shard(w, r, 2) for r in range(2)], dim=1), w)
    assert Shard().shard(w, 1, 2) is w  # replicated


def test_indivisible_heads_are_refused():
    with pytest.raises(ValueError, match="must divide the model's attention heads"):
        LLM("dummy:tiny", device="cpu", tensor_parallel_size=3)


def test_more_cuda_ranks_than_gpus_are_refused_before_any_worker_starts(monkeypatch):
    """On CUDA each rank takes cuda:LOCAL_RANK. With one GPU visible, two ranks are refused
    with the reason (on a one-GPU machine rank 1 used to die on "invalid device ordinal",
    and the engine reported only that a worker had died)."""
    from travelator.engine.tp_executor import TPExecutor
    from travelator.engine.tp_worker import rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    launched = []
    monkeypatch.setattr(TPExecutor, "_launch", lambda self, *a: launched.append(a))
    with pytest.raises(ValueError, match="LOCAL_RANK 1 needs cuda:1, 1 GPU"):
        LLM("dummy:tiny", device="cuda", tensor_parallel_size=2)
    assert launched == []
    with pytest.raises(ValueError, match="LOCAL_RANK 1 needs cuda:1, 1 GPU"):
        rank_device("cuda", 1)  # a torchrun worker's own check


@pytest.mark.parametrize("parallel", [dict(device="cpu", tensor_parallel_size=2),
                                      dict(device="cpu", pipeline_parallel_size=2)])
def test_killed_worker_fails_the_engine_fast(parallel):
    """A tensor-parallel shard or a pipeline stage: the driver notices its death at once."""
    llm = LLM("dummy:tiny", dtype="float32", num_kv_blocks=64, **parallel)
    engine = llm.engine
    (pid,) = engine.runner.worker_pids
    for i in range(4):
        engine.add_request([1] + list(range(10 + i, 60 + i)), greedy(200))
    engine.step()
    engine.step()
    # Kill it while the driver is busy stepping (most likely inside a collective).
    threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"tensor-parallel worker 1 died \(exit code -9\)"):
        while True:
            engine.step()
            assert time.monotonic() - t0 < 10, "the engine kept stepping without its worker"
    assert time.monotonic() - t0 < 5
    # The engine stays failed: every later step says so at once.
    t1 = time.monotonic()
    with pytest.raises(TensorParallelError, match="worker 1 died"):
        engine.step()
    assert time.monotonic() - t1 < 1
    llm.shutdown()


DRIVER = textwrap.dedent("""
    import os, sys, time
    from travelator import LLM
    llm = LLM("dummy:tiny", device="cpu", dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    print(*llm.engine.runner.worker_pids, flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)  # no shutdown(): the exit must still stop the worker
    time.sleep(60)
""")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_orphan_workers(how, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(proc.stdout.readline())
        if how == "sigkill":
            proc.kill()
        proc.wait(timeout=20)
        deadline = time.monotonic() + 5
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), f"worker {pid} outlived its driver ({how})"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_fixed_order_all_reduce_sums_in_rank_order():
    """Three ranks in threads of this process: with ``fixed_order_sums`` every element is
    (p0 + p1) + p2 bitwise, whatever the buffer's size (a ring all-reduce's order depends on
    the size, which is what the batch-invariant mode must avoid)."""
    import torch.distributed as dist

    from travelator.model.tp_group import TPGroup

    store = dist.HashStore()
    size = 3
    g = torch.Generator().manual_seed(0)
    lengths = [1, 7, 64, 1000, 4099]
    inputs = [[(torch.randn(n, generator=g) * 1e3).to(torch.bfloat16) for n in lengths] for _ in range(size)]
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = TPGroup(store, rank, size, b"a secret the ranks share")
            group.connect_data(torch.device("cpu"))
            group.fixed_order_sums = True
            results[rank] = [group.all_reduce(x.clone()) for x in inputs[rank]]
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for i in range(len(lengths)):
        want = (inputs[0][i] + inputs[1][i]) + inputs[2][i]
        for rank in range(size):
            assert torch.equal(results[rank][i], want), (rank, lengths[i])


def test_prompt_logprobs_embeddings_and_scores_under_tensor_parallelism():
    """Every rank takes part in the prompt rows' LM-head gathers; the driver's numbers match
    one rank's, and so do its embeddings (pooled over chunks) and scores."""
    from travelator import SamplingParams
    from travelator.scoring import ScoreFormat

    prompt = [1] + [random.Random(4).randrange(3, 1000) for _ in range(30)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    fmt = ScoreFormat("q: {query} d: {document} ->", ("a", "b"))
    one_llm = LLM("dummy:tiny", device="cpu", dtype="float32", max_num_batched_tokens=8)
    one = one_llm.generate([prompt], params, use_tqdm=False)[0]
    pooled_one = [one_llm.embed([prompt], pooling=how, use_tqdm=False)[0] for how in ("mean", "last")]
    scores_one = one_llm.score("which", ["one text", "another"], score_format=fmt, use_tqdm=False)
    llm = LLM("dummy:tiny", device="cpu", dtype="float32", max_num_batched_tokens=8, tensor_parallel_size=2)
    try:
        two = llm.generate([prompt], params, use_tqdm=False)[0]
        pooled_two = [llm.embed([prompt], pooling=how, use_tqdm=False)[0] for how in ("mean", "last")]
        scores_two = llm.score("which", ["one text", "another"], score_format=fmt, use_tqdm=False)
    finally:
        llm.shutdown()
    for a, b in zip(pooled_one, pooled_two):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-5, rtol=0)
    assert scores_two == pytest.approx(scores_one, abs=1e-5)
    assert two.outputs[0].token_ids == one.outputs[0].token_ids
    for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert list(a.top_logprobs) == list(b.top_logprobs)
