"""Decode-only steps through the graph runner (``engine/decode_graphs.py``): padded up to a
batch-size bucket, on static buffers, with the attention's launch bounds fixed. Without a GPU
the eager strategy replays the same function on the same padded buffers, under Triton's
interpreter, so everything but the recording itself is checked here; the test marked ``cuda``
records real graphs."""

from __future__ import annotations

import pytest
import torch

from travelator import LLM, SamplingParams
from travelator.engine.decode_graphs import DecodeGraphs, bucket_sizes, eager_replay
from travelator.engine.input_batch import StepInputs
from travelator.model.attention import build_metadata, slot_mapping

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 8
MAX_MODEL_LEN = 64


def test_buckets_double_then_step_by_eight_up_to_the_largest_step():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert bucket_sizes(10_000)[-1] == 512


def _tiny_llm(**kwargs) -> LLM:
    return LLM("dummy:tiny", device=DEVICE, kernels="triton", dtype="float32", max_model_len=MAX_MODEL_LEN,
               max_num_batched_tokens=32, max_num_seqs=4, block_size=BLOCK_SIZE, **kwargs)


def _decode_step(requests: list[tuple[int, list[int], int]]) -> StepInputs:
    """A decode-only step: per request (context, block table, token id)."""
    slots = [slot_mapping(table, c, c + 1, BLOCK_SIZE)[0] for c, table, _ in requests]
    meta = build_metadata("triton", torch.tensor(slots, device=DEVICE), [1] * len(requests),
                          [c for c, _, _ in requests], [t for _, t, _ in requests], BLOCK_SIZE,
                          torch.device(DEVICE))
    n = len(requests)
    return StepInputs(torch.tensor([tok for _, _, tok in requests], device=DEVICE),
                      torch.tensor([c for c, _, _ in requests], device=DEVICE), meta, None,
                      [str(i) for i in range(n)], [], [], [])


def test_padded_bucketed_decode_steps_match_the_eager_steps():
    """Steps of 4, 3 and 1 decodes through buckets 1, 2, 4: the logits of the unpadded eager
    steps, and the same KV cache after them (padding rows write nothing, also where a larger
    step's rows were)."""
    runner = _tiny_llm().engine.runner
    model = runner.model
    g = torch.Generator().manual_seed(0)
    start = [(torch.randn(k.shape, generator=g).to(DEVICE), torch.randn(v.shape, generator=g).to(DEVICE))
             for k, v in runner.kv_caches]
    eager = [(k.clone(), v.clone()) for k, v in start]
    padded = [(k.clone(), v.clone()) for k, v in start]
    graphs = DecodeGraphs(model, padded, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                          device=torch.device(DEVICE), buckets=[1, 2, 4], capture=eager_replay)
    requests = [(5, [3], 11), (17, [1, 6, 2], 12), (9, [7, 4], 13), (30, [8, 9, 10, 5], 14)]
    for i, step in enumerate((requests, requests[:3], requests[2:3])):
        if i == 1:  # the fourth request's block goes to another one: its slot must stay as written
            for k, v in (*eager, *padded):
                k[5, :, 6], v[5, :, 6] = 0.5, -0.5
        inputs = _decode_step(step)
        assert graphs.takes(inputs)
        want = model.compute_logits(model(inputs.input_ids, inputs.positions, eager, inputs.meta))
        got = graphs.run(inputs)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert graphs.replays == {4: 2, 1: 1}
    for (k, v), (k_want, v_want) in zip(padded, eager):
        torch.testing.assert_close(k, k_want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v, v_want, atol=1e-6, rtol=1e-6)


def test_steps_the_graphs_do_not_take_run_eagerly():
    runner = _tiny_llm().engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                          device=torch.device(DEVICE), buckets=[1, 2], capture=eager_replay)
    assert not graphs.takes(_decode_step([(1, [0], 5)] * 3))  # past the largest bucket
    chunk = _decode_step([(1, [0], 5)])
    chunk.meta.max_query_len = 2  # a prefill chunk
    assert not graphs.takes(chunk)
    sampled_short = _decode_step([(1, [0], 5), (2, [1], 6)])
    sampled_short.logits_indices = torch.tensor([1])  # a row that samples nothing
    assert not graphs.takes(sampled_short)


def _generate(llm: LLM) -> list:
    prompts = [list(range(5, 25)), list(range(100, 103)), list(range(200, 211))]
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True) for n in (7, 3, 5)]
    return [r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False)]


def test_an_engine_with_eager_replayed_graphs_matches_the_eager_engine():
    """The whole engine: prefill chunks eagerly, decode steps of 3, 2 and 1 requests through
    buckets 4, 2 and 1; the same greedy tokens, logprobs within float32 rounding."""
    want = _generate(_tiny_llm(enforce_eager=True))
    llm = _tiny_llm()
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, max_model_len=MAX_MODEL_LEN,
                                 block_size=BLOCK_SIZE, device=torch.device(DEVICE), buckets=[1, 2, 4],
                                 capture=eager_replay)
    got = _generate(llm)
    assert set(runner.graphs.replays) == {1, 2, 4}
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)


@pytest.mark.cuda
def test_recorded_cuda_graphs_give_the_eager_engines_tokens():
    """Real CUDA graphs recorded at start-up, against enforce_eager."""
    eager = _generate(_tiny_llm(enforce_eager=True))
    llm = _tiny_llm()
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.buckets == [1, 2, 4]
    got = _generate(llm)
    assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert [g.token_ids for g in got] == [e.token_ids for e in eager]
