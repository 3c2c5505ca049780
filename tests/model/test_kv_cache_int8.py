"""The int8 KV cache (``kv_cache_dtype="int8"``): its row format against hand-worked numbers,
the native write and attention against the torch form and a float64 reference, and a real
model's next-token distributions and greedy text against the float cache's."""

from __future__ import annotations

import random

import pytest
import torch
from paths import STORIES, STORIES_EXPECTED, needs_stories
from attention_reference import attend, random_requests, reference
from test_quantization import compare, sequence_logprobs

from travelator import LLM, SamplingParams, kernels
from travelator.model import kv_layout

native = pytest.mark.skipif(not kernels.available(), reason="native kernels do not build here")


def test_rows_store_codes_and_their_scale():
    x = torch.tensor([[[0.5, -1.27, 0.0, 0.01]], [[0.0, 0.0, 0.0, 0.0]], [[1.0, float("nan"), 2.0, 3.0]]])
    rows = kv_layout.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 1, 4 + kv_layout.INT8_SCALE_BYTES)
    # max |x| = 1.27 -> scale 0.01: codes are x / 0.01, rounded.
    assert rows[0, 0, :4].tolist() == [50, -127, 0, 1]
    assert rows[0, 0, 4:].contiguous().view(torch.float32).item() == pytest.approx(0.01)
    assert rows[1, 0, :4].tolist() == [0, 0, 0, 0]  # an all-zero row: scale 0, no division by it
    back = kv_layout.dequantize_rows(rows, torch.float32)
    torch.testing.assert_close(back[0], x[0], atol=0.005, rtol=0)  # half a step at most
    assert torch.equal(back[1], x[1])
    assert back[2].isnan().all()  # a NaN poisons its own row only, never reads back as a number
    assert not back[:2].isnan().any()


def test_pool_holds_more_tokens_in_the_same_bytes():
    assert kv_layout.bytes_per_token(8, 4, 64, torch.bfloat16) == 2 * 8 * 4 * 64 * 2
    assert kv_layout.bytes_per_token(8, 4, 64, torch.int8) == 2 * 8 * 4 * 68  # 64 codes + a float32 scale
    blocks = {}
    for kv_dtype in ("bfloat16", "int8"):
        llm = LLM("dummy:tiny", device="cpu", dtype="bfloat16", kv_cache_dtype=kv_dtype, kv_cache_bytes=1 << 20, max_model_len=256)
        k = llm.engine.runner.kv_caches[0][0]
        blocks[kv_dtype] = k.shape[0]
    assert k.dtype == torch.int8 and k.shape[1:] == (2, 16, 32 + 4)  # tiny: 2 KV heads of 32, blocks of 16
    # Per token and layer: 2 x 2 heads x 32 x 2 bytes in bf16, 2 x 2 x 36 bytes in int8.
    assert blocks == {"bfloat16": (1 << 20) // (16 * 2 * 2 * 2 * 64), "int8": (1 << 20) // (16 * 2 * 2 * 2 * 36)}


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])  # float16: the scalar writer
@pytest.mark.parametrize("d", [64, 20])  # 20: a row ends inside a vector
def test_native_write_stores_the_torch_bytes(dtype, d):
    g = torch.Generator().manual_seed(0)
    tokens, kvh = 21, 2
    qkv = (torch.randn(tokens, 8 * d, generator=g) * 3).to(dtype)
    k = qkv[:, 4 * d:6 * d].view(tokens, kvh, d)  # row-strided views, as the model hands them over
    v = qkv[:, 6 * d:].view(tokens, kvh, d)
    k[3, 1, 5] = float("inf")
    v[7, 0, 2] = float("nan")
    if dtype != torch.float16:  # a row so small that 127 / max|x| overflows a float: codes 0
        k[5, 0] = 2e-37 * torch.sign(k[5, 0])
    slots = torch.randperm(10 * 16, generator=g)[:tokens]
    shape = kv_layout.cache_shape(10, 16, kvh, d, torch.int8)
    k_cache, v_cache = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    torch.ops.travelator.write_kv_(k_cache, v_cache, slots, k, v)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):  # block slot // 16, every head, place slot % 16
        want_k[slot // 16, :, slot % 16] = kv_layout.quantize_rows(k[t])
        want_v[slot // 16, :, slot % 16] = kv_layout.quantize_rows(v[t])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def int8_caches(num_blocks, block_size, kvh, d, seed):
    g = torch.Generator().manual_seed(seed)
    # A few large values per row, as real keys have: each row's own scale absorbs them.
    keys = torch.randn(num_blocks, block_size, kvh, d, generator=g) * (1 + 4 * (torch.rand(d, generator=g) > 0.9))
    values = torch.randn(num_blocks, block_size, kvh, d, generator=g)
    # As the cache lays them out: [blocks, kv heads, block_size, row].
    return (kv_layout.quantize_rows(x).transpose(1, 2).contiguous() for x in (keys, values))


@pytest.mark.parametrize("backend", [pytest.param("native", marks=native), "torch"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size,heads,kvh,d", [(16, 8, 4, 64), (8, 4, 1, 128), (4, 6, 2, 32), (8, 4, 4, 20)])
def test_attention_over_int8_rows_matches_the_reference(backend, dtype, tol, block_size, heads, kvh, d):
    """Decodes and prefill chunks over an int8 cache equal float64 attention over the same rows
    dequantized: the kernels read the format exactly (d=20 takes the portable C++ path)."""
    rng = random.Random(d + heads)
    k_rows, v_rows = int8_caches(200, block_size, kvh, d, seed=d)
    reqs = random_requests(rng, 200, block_size, n_decodes=5, n_prefills=4)
    reqs.append((300, 1, list(range(-(-301 // block_size)))))  # a decode past the 256-key chunk
    total = sum(n for _, n, _ in reqs)
    q = torch.randn(total, heads, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = reference(q, kv_layout.dequantize_rows(k_rows, torch.float64), kv_layout.dequantize_rows(v_rows, torch.float64),
                    reqs, d**-0.5)
    got = attend(backend, q, k_rows, v_rows, reqs, heads, kvh, d)
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)


@needs_stories
def test_stories260k_with_an_int8_cache_stays_close_and_keeps_the_story():
    base = LLM(str(STORIES), device="cpu", dtype="float32")
    ids = base.tokenizer.encode(STORIES_EXPECTED)
    ref = sequence_logprobs(base, ids)
    llm = LLM(str(STORIES), device="cpu", dtype="float32", kv_cache_dtype="int8")
    kl, top1 = compare(ref, sequence_logprobs(llm, ids))
    print(f"stories260K, int8 KV cache: mean KL {kl:.5f} nats, top-1 agreement {top1:.3f} over {len(ids)} positions")
    assert kl <= 0.002 and top1 >= 0.97, (kl, top1)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    assert ("Once upon a time" + out.text).startswith(STORIES_EXPECTED)
