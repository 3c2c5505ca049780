"""The Triton paged attention and KV write against the float64 reference that checks the CPU
kernel. Without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, which
conftest.py sets before anything imports triton), on the CPU."""

from __future__ import annotations

import random

import pytest
import torch
from attention_reference import make_cache, random_requests, reference

from travelator.kernels import triton_attention
from travelator.model.attention import build_metadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(q, k_cache, v_cache, reqs, scale, window=None, sinks=None):
    """The kernel over ``reqs`` ((context, query_len, block table) in batch order), with the
    metadata the engine builds for it."""
    meta = build_metadata("triton", torch.empty(0, dtype=torch.long), [n for _, n, _ in reqs],
                          [c for c, _, _ in reqs], [t for _, _, t in reqs], k_cache.shape[2],
                          torch.device(DEVICE))
    out = triton_attention.paged_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta.query_start, meta.seq_lens,
        meta.block_tables, scale, window or 0, meta.max_query_len, meta.max_seq_len,
        None if sinks is None else sinks.to(DEVICE))
    return out.cpu()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kvh,d,block_size", [
    (4, 4, 64, 16),  # multi-head
    (8, 2, 80, 16),  # GQA of 4, a head size padded to 128 lanes
    (6, 2, 32, 8),  # a group of 3, blocks smaller than a key tile
])
@pytest.mark.parametrize("window", [None, 5])
def test_mixed_batches_match_the_float64_reference(dtype, tol, heads, kvh, d, block_size, window):
    rng = random.Random(heads * 100 + d + (window or 0))
    for trial in range(2):
        k_cache, v_cache = make_cache(64, block_size, kvh, d, dtype, seed=trial)
        reqs = random_requests(rng, 64, block_size, n_decodes=3, n_prefills=3)
        q = torch.randn(sum(n for _, n, _ in reqs), heads, d).to(dtype)
        got = run(q, k_cache, v_cache, reqs, d**-0.5, window)
        want = reference(q, k_cache, v_cache, reqs, d**-0.5, window)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 300])
def test_long_decodes_split_over_keys_match_the_reference(window):
    """Decode-only steps past KEYS_PER_SPLIT keys take the split kernel and its merge."""
    block_size, kvh, heads, d = 16, 2, 4, 32
    k_cache, v_cache = make_cache(200, block_size, kvh, d, torch.float32, seed=3)
    blocks = list(range(200))
    random.Random(7).shuffle(blocks)
    reqs = []
    for context in (1300, 40, 700):  # three, two (after padding to four) and one split
        need = -(-(context + 1) // block_size)
        reqs.append((context, 1, blocks[:need]))
        blocks = blocks[need:]
    assert max(c for c, _, _ in reqs) + 1 > 2 * triton_attention.KEYS_PER_SPLIT
    q = torch.randn(3, heads, d)
    got = run(q, k_cache, v_cache, reqs, d**-0.5, window)
    torch.testing.assert_close(got.double(), reference(q, k_cache, v_cache, reqs, d**-0.5, window),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("split", [False, True])
def test_sinks_match_the_reference(split):
    """gpt-oss's sinks in the one-pass kernel (mixed batches) and in the split kernel's merge
    (long decodes)."""
    block_size, kvh, heads, d = 16, 2, 4, 32
    k_cache, v_cache = make_cache(200, block_size, kvh, d, torch.float32, seed=4)
    if split:
        reqs = [(1300, 1, list(range(0, 82))), (700, 1, list(range(82, 126)))]
    else:
        reqs = random_requests(random.Random(9), 200, block_size, n_decodes=3, n_prefills=3)
    q = torch.randn(sum(n for _, n, _ in reqs), heads, d)
    sinks = torch.tensor([-3.0, 0.0, 2.5, 8.0])
    got = run(q, k_cache, v_cache, reqs, d**-0.5, 300 if split else 5, sinks)
    want = reference(q, k_cache, v_cache, reqs, d**-0.5, 300 if split else 5, sinks)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("max_seq_len", [300, 4 * triton_attention.KEYS_PER_SPLIT])
def test_fixed_bounds_of_a_recorded_decode_step_keep_the_result(max_seq_len):
    """A recorded decode step launches with fixed bounds (one query per row, max_model_len
    keys): splits past a short sequence's keys merge as empty, and a padding row (sequence
    length 0) reads nothing and gets zeros."""
    block_size, kvh, heads, d = 8, 2, 4, 32
    k_cache, v_cache = make_cache(16, block_size, kvh, d, torch.float32, seed=5)
    reqs = [(12, 1, [3, 7]), (0, 1, [5]), (30, 1, [1, 2, 9, 4])]
    q = torch.randn(4, heads, d)
    query_start = torch.arange(5)
    seq_lens = torch.tensor([13, 1, 31, 0])
    tables = torch.tensor([[3, 7, 0, 0], [5, 0, 0, 0], [1, 2, 9, 4], [0, 0, 0, 0]])
    out = triton_attention.paged_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), query_start.to(DEVICE), seq_lens.to(DEVICE),
        tables.to(DEVICE), d**-0.5, 0, 1, max_seq_len).cpu()
    want = reference(q[:3], k_cache, v_cache, reqs, d**-0.5)
    torch.testing.assert_close(out[:3].double(), want, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_kv_write_puts_each_row_at_its_slot_and_skips_padding():
    blocks, kvh, block_size, d = 6, 2, 4, 24
    k_cache = torch.zeros(blocks, kvh, block_size, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(5, kvh, d, device=DEVICE), torch.randn(5, kvh, d, device=DEVICE)
    slots = torch.tensor([9, 0, -1, 23, 14], device=DEVICE)
    triton_attention.write_kv(k_cache, v_cache, slots, k, v)
    for cache, rows in ((k_cache, k), (v_cache, v)):
        want = torch.zeros_like(cache)
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                want[slot // block_size, :, slot % block_size] = rows[t]
        assert torch.equal(cache, want)


def test_an_int8_cache_is_refused_with_the_reason():
    cache = torch.zeros(2, 1, 4, 36, dtype=torch.int8)
    with pytest.raises(ValueError, match="float KV caches"):
        triton_attention.paged_attention(torch.zeros(1, 1, 32), cache, cache, torch.tensor([0, 1]),
                                         torch.tensor([1]), torch.tensor([[0]]), 1.0, 0, 1, 1)


def test_an_engine_on_the_triton_path_matches_the_torch_path():
    """The whole engine with kernels="triton" (under the interpreter here): chunked prefill,
    decodes beside prefill chunks, GQA; the same greedy tokens as the torch path, logprobs
    within float32 rounding."""
    from travelator import LLM, SamplingParams

    prompts = [list(range(5, 45)), list(range(100, 103)), list(range(200, 227))]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    runs = {}
    for kernels in ("torch", "triton"):
        llm = LLM("dummy:tiny", device=DEVICE, kernels=kernels, dtype="float32",
                  max_num_batched_tokens=32, max_num_seqs=3, block_size=8)
        runs[kernels] = [r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False)]
    for torch_out, triton_out in zip(runs["torch"], runs["triton"]):
        assert triton_out.token_ids == torch_out.token_ids
        got = [lp.logprob for lp in triton_out.logprobs]
        want = [lp.logprob for lp in torch_out.logprobs]
        assert got == pytest.approx(want, abs=1e-4)


def test_the_triton_path_is_refused_on_a_cpu_outside_the_interpreter(monkeypatch):
    from travelator.model.ops import make_ops

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="runs on a CUDA device"):
        make_ops("triton", torch.device("cpu"))


def test_an_int8_kv_cache_on_the_triton_path_is_refused_at_start():
    from travelator import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype int8"):
        LLM("dummy:tiny", device=DEVICE, kernels="triton", kv_cache_dtype="int8")
