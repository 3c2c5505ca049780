"""The native paged-attention kernel against an independent float64 reference, against
the pure-torch fallback, and for batch invariance (a row's result never depends on what
else is in the call, nor on how its prompt was chunked); with and without a sliding window."""

from __future__ import annotations

import random

import pytest
import torch
from amx_expected import amx_routes_expected
from attention_reference import attend, make_cache, metadata, random_requests, reference

from travelator import kernels
from travelator.model import kv_layout
from travelator.model.attention import PagedAttention, _TorchAttention

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels do not build here")


@pytest.mark.parametrize("dtype,kv_dtype,tol", [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, 2e-2),
    (torch.float32, torch.bfloat16, 1e-5),
    (torch.float16, torch.float16, 2e-3),
])
@pytest.mark.parametrize("block_size,heads,kvh,d", [(16, 8, 4, 64), (4, 6, 2, 32), (8, 4, 4, 20)])
@pytest.mark.parametrize("tiled,amx_tiles", [(False, True), (True, True), (True, False)])
def test_native_matches_reference_and_torch(dtype, kv_dtype, tol, block_size, heads, kvh, d, tiled, amx_tiles):
    rng = random.Random(block_size * 100 + d)
    k_cache, v_cache = make_cache(200, block_size, kvh, d, kv_dtype, seed=d)
    reqs = random_requests(rng, 200, block_size, n_decodes=5, n_prefills=4)
    total = sum(n for _, n, _ in reqs)
    q = torch.randn(total, heads, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = d**-0.5
    ref = reference(q, k_cache, v_cache, reqs, scale)
    native = attend("native", q, k_cache, v_cache, reqs, heads, kvh, d, tiled, amx_tiles=amx_tiles)
    fallback = attend("torch", q, k_cache, v_cache, reqs, heads, kvh, d)
    torch.testing.assert_close(native.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(fallback.double(), ref, atol=tol * 2, rtol=tol * 2)


def requests_with_blocks(rng, shapes, block_size):
    """(context, query rows, block table) for each (context, rows), blocks at random places."""
    need = [-(-(context + n) // block_size) for context, n in shapes]
    blocks = rng.sample(range(sum(need)), sum(need))
    reqs = []
    for (context, n), k in zip(shapes, need):
        reqs.append((context, n, blocks[:k]))
        blocks = blocks[k:]
    return reqs, sum(need)


@pytest.mark.parametrize("dtype,kv_dtype,tol", [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, 2e-2),
])
@pytest.mark.parametrize("heads,kvh,d", [(8, 4, 64), (4, 1, 128), (2, 2, 32)])
@pytest.mark.parametrize("tiled,amx_tiles", [(False, True), (True, True), (True, False)])
def test_long_contexts_match_the_reference(dtype, kv_dtype, tol, heads, kvh, d, tiled, amx_tiles):
    """Contexts past the kernel's key chunk (256 positions), decodes and prefill chunks."""
    bs = 16
    shapes = [(255, 1), (256, 1), (700, 1), (511, 1), (240, 40), (600, 33), (0, 150), (65, 70)]
    reqs, num_blocks = requests_with_blocks(random.Random(d), shapes, bs)
    k_cache, v_cache = make_cache(num_blocks, bs, kvh, d, kv_dtype, seed=d + 1)
    total = sum(n for _, n, _ in reqs)
    q = torch.randn(total, heads, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    ref = reference(q, k_cache, v_cache, reqs, d**-0.5)
    native = attend("native", q, k_cache, v_cache, reqs, heads, kvh, d, tiled, amx_tiles=amx_tiles)
    torch.testing.assert_close(native.double(), ref, atol=tol, rtol=tol)


def attend_strided(q, k_cache, v_cache, reqs, heads, kvh, d, tiled, amx_tiles=True):
    """attend() with q's rows strided, as the model's q (a slice of its QKV projection) is."""
    wide = torch.zeros(q.shape[0], heads + 3, d, dtype=q.dtype)
    wide[:, :heads] = q
    return attend("native", wide[:, :heads], k_cache, v_cache, reqs, heads, kvh, d, tiled, amx_tiles=amx_tiles)


@pytest.mark.parametrize("heads,kvh,d,block_size", [(8, 4, 64, 16), (4, 1, 128, 16), (2, 2, 32, 4), (4, 2, 20, 16),
                                                    (2, 1, 256, 8)])
@pytest.mark.parametrize("amx_tiles", [True, False])
def test_long_prefill_chunks_match_the_reference(heads, kvh, d, block_size, amx_tiles):
    """Prompt chunks on the tiled route's kernels on AMX CPUs (elsewhere the vector kernels take
    them): the tiled kernel's products on the tiles (attention_tiles_amx.h) for whole prompts and
    later chunks, and ATen's flash attention (attention_flash.h) for chunks of many rows over many
    keys (the keys before the chunk attended apart and merged by log-sum-exp), chunks at and one
    row or one key below the flash route's thresholds, beside decodes, q's rows strided, against
    the float64 reference; head_dims the vector kernels have no special path for among them."""
    rng = random.Random(block_size * 10 + d)
    shapes = [(37, 1), (500, 1), (0, 300), (200, 256), (1000, 170), (0, 159), (3, 161), (40, 160),
              (1400, 170), (1376, 160), (1375, 160), (1377, 159)]
    reqs, num_blocks = requests_with_blocks(rng, shapes, block_size)
    k_cache, v_cache = make_cache(num_blocks, block_size, kvh, d, torch.bfloat16, seed=d + 5)
    total = sum(n for _, n, _ in reqs)
    q = torch.randn(total, heads, d, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ref = reference(q, k_cache, v_cache, reqs, d**-0.5)
    native = attend_strided(q, k_cache, v_cache, reqs, heads, kvh, d, tiled=True, amx_tiles=amx_tiles)
    torch.testing.assert_close(native.double(), ref, atol=2e-2, rtol=2e-2)


def test_a_chunk_after_a_long_context_matches_the_reference():
    """A chunk after more keys than the flash route takes in one call (8,192): the keys before
    it are attended in slices, all merged."""
    heads, kvh, d, bs = 2, 1, 32, 16
    reqs, num_blocks = requests_with_blocks(random.Random(9), [(8500, 170), (20, 1)], bs)
    k_cache, v_cache = make_cache(num_blocks, bs, kvh, d, torch.bfloat16, seed=6)
    q = torch.randn(171, heads, d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ref = reference(q, k_cache, v_cache, reqs, d**-0.5)
    native = attend("native", q, k_cache, v_cache, reqs, heads, kvh, d, tiled=True)
    torch.testing.assert_close(native.double(), ref, atol=2e-2, rtol=2e-2)


def test_the_flash_route_is_built_where_the_build_and_cpu_have_amx():
    """The routes above (ATen's flash attention, the tiled kernel's products on the tiles) exist
    wherever the CPU and the build's target have AMX's bf16 tiles (else those tests pass
    through the vector kernels)."""
    assert torch.ops.travelator.attention_flash_route() == amx_routes_expected()


def test_metadata_that_does_not_fit_is_refused():
    """A request with fewer keys than queries, more keys than its table holds, or query starts
    that do not span q: an error, not a read past the cache."""
    heads, kvh, d, bs = 2, 1, 32, 16
    k_cache, v_cache = make_cache(8, bs, kvh, d, torch.bfloat16, seed=1)
    q = torch.randn(20, heads, d).to(torch.bfloat16)
    table = torch.arange(4).view(1, 4)
    for starts, lens in [([0, 20], [19]), ([0, 20], [65]), ([0, 19], [20]), ([1, 20], [20])]:
        with pytest.raises(RuntimeError, match="paged_attention"):
            torch.ops.travelator.paged_attention(q, k_cache, v_cache, torch.tensor(starts), torch.tensor(lens),
                                                 table, d**-0.5, True)


def stored(rows, table, cache):
    """cache ([blocks, kv heads, block_size, d]) with rows[p] ([kv heads, d]) at position p of
    the blocks of table."""
    positions = torch.arange(rows.shape[0])
    bs = cache.shape[2]
    cache[torch.tensor(table)[positions // bs], :, positions % bs] = rows
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prompt_len,chunks", [(53, (1, 5, 17)), (300, (7, 64))])
def test_rows_do_not_depend_on_the_batch_or_the_chunking(dtype, prompt_len, chunks):
    heads, kvh, d, bs = 8, 4, 64, 16
    k_cache, v_cache = make_cache(300, bs, kvh, d, dtype, seed=3)
    rng = random.Random(7)
    # One prompt at context 0, its blocks at random places.
    table = rng.sample(range(300), -(-prompt_len // bs))
    q_all = torch.randn(prompt_len, heads, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    whole = attend("native", q_all, k_cache, v_cache, [(0, prompt_len, table)], heads, kvh, d)
    # The same rows computed in chunks, each as a decode or a chunk with context.
    for chunk in chunks:
        for start in range(0, prompt_len, chunk):
            n = min(chunk, prompt_len - start)
            others = random_requests(rng, 300, bs, n_decodes=rng.randint(0, 6), n_prefills=rng.randint(0, 3))
            others = [(c, m, [b for b in t if b not in table] or [299]) for c, m, t in others]
            others = [(c, m, t) for c, m, t in others if len(t) * bs >= c + m]
            mine = (start, n, table)
            reqs = sorted(others + [mine], key=lambda r: r[1] != 1)  # decodes first
            rows = []
            q_parts = []
            for r in reqs:
                if r is mine:
                    rows.append(sum(x[1] for x in q_parts))
                    q_parts.append((q_all[start : start + n], n))
                else:
                    q_parts.append((torch.randn(r[1], heads, d).to(dtype), r[1]))
            q = torch.cat([p for p, _ in q_parts])
            out = attend("native", q, k_cache, v_cache, reqs, heads, kvh, d)
            got = out[rows[0] : rows[0] + n]
            assert torch.equal(got, whole[start : start + n]), (chunk, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiled", [False, True])
def test_a_lone_request_split_over_kv_heads_matches_itself_in_a_batch(dtype, tiled):
    """One request alone is fewer work items than threads, so the kernel splits it over its KV
    heads: the same rows as in a batch of four (not split), bit for bit, and the reference.
    A decode at 700 keys and a 12-query chunk at 300."""
    heads, kvh, d, bs = 8, 4, 64, 16
    k_cache, v_cache = make_cache(200, bs, kvh, d, dtype, seed=11)
    rng = random.Random(5)
    blocks = rng.sample(range(200), 200)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for context, n in [(699, 1), (300, 12)]:
            need = -(-(context + n) // bs)
            mine = (context, n, blocks[:need])
            others = [(c, 1, blocks[need + 3 * i: need + 3 * i + 3]) for i, c in enumerate((20, 35, 47))]
            q = torch.randn(n + 3, heads, d, generator=torch.Generator().manual_seed(context)).to(dtype)
            alone = attend("native", q[:n], k_cache, v_cache, [mine], heads, kvh, d, tiled)
            reqs = [mine] + others if n == 1 else others + [mine]  # decodes first
            q_batch = q if n == 1 else torch.cat([q[n:], q[:n]])
            batch = attend("native", q_batch, k_cache, v_cache, reqs, heads, kvh, d, tiled)
            in_batch = batch[:n] if n == 1 else batch[3:]
            assert torch.equal(alone, in_batch), (context, n)
            ref = reference(q[:n], k_cache, v_cache, [mine], d**-0.5)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(alone.double(), ref, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 20])  # 20: the portable path on every CPU
@pytest.mark.parametrize("window", [None, 11])
# Query heads a KV head serves: 2, 7 and 8 (the AVX2 path takes a query's in blocks of 4, 2, 1).
@pytest.mark.parametrize("heads,kvh", [(4, 2), (7, 1), (16, 2)])
def test_rows_do_not_depend_on_the_block_size(dtype, d, window, heads, kvh):
    """The same keys at the same positions, stored in blocks of 4, 8, 16, 5 or 48 (at scattered
    places): the same rows, bit for bit, with a sliding window too. Engines with different
    block sizes must agree."""
    n_keys = 75
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(n_keys, kvh, d, generator=g).to(dtype)
    vals = torch.randn(n_keys, kvh, d, generator=g).to(dtype)
    q = torch.randn(n_keys, heads, d, generator=g).to(dtype)
    outs = []
    for bs in (4, 8, 16, 5, 48):
        num_blocks = 40
        table = random.Random(bs).sample(range(num_blocks), -(-n_keys // bs))
        k_cache = stored(keys, table, torch.randn(num_blocks, kvh, bs, d, generator=g).to(dtype))  # stale numbers around
        v_cache = stored(vals, table, torch.randn(num_blocks, kvh, bs, d, generator=g).to(dtype))
        # A prompt of 70 queries at context 0 and a decode at 74 keys: every chunk boundary.
        prompt = attend("native", q[:70], k_cache, v_cache, [(0, 70, table)], heads, kvh, d, window=window)
        decode = attend("native", q[74:75], k_cache, v_cache, [(74, 1, table)], heads, kvh, d, window=window)
        outs.append(torch.cat([prompt, decode]))
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    ref = reference(q[:70], k_cache, v_cache, [(0, 70, table)], d**-0.5, window)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(outs[-1][:70].double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("amx_tiles", [True, False])
@pytest.mark.parametrize("d,window", [(64, None), (32, 21), (128, 40)])
def test_tiled_rows_do_not_depend_on_the_block_size(amx_tiles, d, window):
    """The tiled kernel (on AMX's tiles: keys read in place from blocks of a multiple of 16
    positions, where a tile may start inside a block, gathered from others) over the same keys
    in blocks of 4 to 48 positions, powers of two and not: the same rows, bit for bit, near the
    reference. Every slot that holds no key is NaN, so that one read past a request's keys, or
    one before its window, shows."""
    heads, kvh = 6, 2
    g = torch.Generator().manual_seed(d)
    n_keys = 150
    keys, vals = (torch.randn(n_keys, kvh, d, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(n_keys, heads, d, generator=g).to(torch.bfloat16)
    outs = []
    for bs in (4, 8, 12, 16, 24, 32, 48):
        num_blocks = 2 * -(-n_keys // bs) + 3
        table = random.Random(bs).sample(range(num_blocks), -(-n_keys // bs))
        k_cache, v_cache = (stored(rows, table, torch.full((num_blocks, kvh, bs, d), float("nan"), dtype=torch.bfloat16))
                            for rows in (keys, vals))
        # A whole prompt of 100 rows and a chunk of 50 after it.
        reqs = [(0, 100, table), (100, 50, table)]
        outs.append(attend("native", q, k_cache, v_cache, reqs, heads, kvh, d, True, window, amx_tiles=amx_tiles))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    keys_cache, vals_cache = (t.view(n_keys, 1, kvh, d).transpose(1, 2).contiguous() for t in (keys, vals))
    one_block_each = [(0, 100, list(range(100))), (100, 50, list(range(150)))]
    ref = reference(q, keys_cache, vals_cache, one_block_each, d**-0.5, window)
    torch.testing.assert_close(outs[0].double(), ref, atol=2e-2, rtol=2e-2)


# ---- sliding windows ------------------------------------------------------------------------

# A table entry no kernel may follow: far past any cache (a native read there faults, a torch
# gather raises).
UNREADABLE = 1 << 40


def windowed_requests(rng, block_size, window):
    """Decodes and prefill chunks, in flat order (decodes first), whose first query sees keys
    from just before, at and after block and key-chunk boundaries (the kernels take keys in
    chunks of 32, 64 or 256 positions), chunks that straddle their first query's window start
    and chunks longer than the window; and the blocks they need. A window past 600 keys
    is longer than every context. Block 0 is left out
    (build_metadata pads with it); the entries of blocks wholly before a request's first
    visible key are UNREADABLE."""
    shapes = [(c, 1) for c in (0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 255, 256, 257, 300, 513)]
    shapes += [(0, 40), (5, 30), (63, 2), (250, 20), (0, 70), (rng.randint(1, 90), rng.randint(2, 40))]
    if window <= 600:
        shapes += [(window - 1, 1), (window, 1), (window + 1, 1), (window - 2, 9), (window + 3, 20)]
    shapes = sorted({(max(c, 0), n) for c, n in shapes}, key=lambda r: r[1] != 1)
    num_blocks = 1 + sum(-(-(c + n) // block_size) for c, n in shapes)
    blocks = rng.sample(range(1, num_blocks), num_blocks - 1)
    reqs = []
    for context, n in shapes:
        need = -(-(context + n) // block_size)
        table, blocks = blocks[:need], blocks[need:]
        first = max(0, context - window + 1) // block_size  # block of the first visible key
        reqs.append((context, n, [UNREADABLE] * first + table[first:]))
    return reqs, num_blocks


def window_caches(kv_dtype, num_blocks, block_size, kvh, d, seed):
    """K and V caches, and their float64 values for the reference."""
    if kv_dtype != torch.int8:
        k, v = make_cache(num_blocks, block_size, kvh, d, kv_dtype, seed)
        return k, v, k.double(), v.double()
    g = torch.Generator().manual_seed(seed)
    rows = [kv_layout.quantize_rows(torch.randn(num_blocks, kvh, block_size, d, generator=g)) for _ in range(2)]
    return (*rows, *(kv_layout.dequantize_rows(r, torch.float64) for r in rows))


def readable(reqs, stand_in):
    """The requests with their UNREADABLE entries naming a real block (for the reference)."""
    return [(c, n, [stand_in if b == UNREADABLE else b for b in t]) for c, n, t in reqs]


def torch_attend(q, k_cache, v_cache, k_ref, v_ref, reqs, heads, kvh, d, window):
    """The torch backend, handed the queries' own keys and values as the model hands them
    over (a chunk at context 0 attends to those, not to the cache), already in the cache."""
    bs = k_cache.shape[2]
    pos = torch.tensor([p for c, n, _ in reqs for p in range(c, c + n)], dtype=torch.long)
    blocks = torch.tensor([t[p // bs] for c, n, t in reqs for p in range(c, c + n)], dtype=torch.long)
    k, v = (cache[blocks, :, pos % bs].to(q.dtype) for cache in (k_ref, v_ref))
    attn = PagedAttention(heads, kvh, d, window=window)
    return _TorchAttention(attn, None)(q, k, v, k_cache, v_cache, metadata(reqs, "torch", bs))


@pytest.mark.parametrize("dtype,kv_dtype,tol,tiled,amx_tiles", [
    (torch.float32, torch.float32, 1e-5, False, True),
    (torch.bfloat16, torch.bfloat16, 2e-2, False, True),
    (torch.bfloat16, torch.bfloat16, 2e-2, True, True),  # the tiled kernel: bf16 queries and cache only
    (torch.bfloat16, torch.bfloat16, 2e-2, True, False),  # ... its vector products where AMX's tiles are
    (torch.float32, torch.bfloat16, 1e-5, False, True),
    (torch.float16, torch.float16, 2e-3, False, True),
    (torch.float32, torch.int8, 1e-5, False, True),
    (torch.bfloat16, torch.int8, 2e-2, False, True),
])
@pytest.mark.parametrize("block_size,heads,kvh,d", [(16, 8, 4, 64), (4, 6, 2, 32), (8, 4, 4, 20), (16, 4, 1, 128),
                                                  (16, 4, 1, 256)])  # 256: Gemma 3's heads
def test_sliding_window_matches_reference_and_torch(dtype, kv_dtype, tol, tiled, amx_tiles, block_size, heads, kvh, d):
    """Windows of 1 key, smaller than a block, one block, not a multiple of the block size
    nor of a key chunk, and longer than every context (then the same bits as no window),
    over decodes and prefill chunks on every path the shapes take (head_dim 20: the portable
    one; 32, 64, 128, 256: AVX2 or AVX-512, and the tiled bf16 kernel where built). The blocks
    before each request's window are table entries no backend may read."""
    scale = d**-0.5
    for window in (1, 3, block_size, 21, 40, 1000):
        rng = random.Random(window * 7 + d)
        reqs, num_blocks = windowed_requests(rng, block_size, window)
        k_cache, v_cache, k_ref, v_ref = window_caches(kv_dtype, num_blocks, block_size, kvh, d, seed=d + window)
        total = sum(n for _, n, _ in reqs)
        q = torch.randn(total, heads, d, generator=torch.Generator().manual_seed(window)).to(dtype)
        ref = reference(q, k_ref, v_ref, readable(reqs, 0), scale, window)
        native = attend("native", q, k_cache, v_cache, reqs, heads, kvh, d, tiled, window, amx_tiles=amx_tiles)
        torch.testing.assert_close(native.double(), ref, atol=tol, rtol=tol, msg=lambda m: f"window {window}: {m}")
        fallback = torch_attend(q, k_cache, v_cache, k_ref, v_ref, reqs, heads, kvh, d, window)
        torch.testing.assert_close(fallback.double(), ref, atol=tol * 2, rtol=tol * 2,
                                   msg=lambda m: f"window {window}: {m}")
        if window == 1000:  # past every context: exactly full attention
            full = attend("native", q, k_cache, v_cache, reqs, heads, kvh, d, tiled, amx_tiles=amx_tiles)
            assert torch.equal(native, full)


@pytest.mark.parametrize("dtype,tol,tiled,amx_tiles", [(torch.float32, 1e-5, False, True),
                                                       (torch.bfloat16, 2e-2, False, True),
                                                       (torch.bfloat16, 2e-2, True, True),
                                                       (torch.bfloat16, 2e-2, True, False)])
@pytest.mark.parametrize("heads,kvh,d", [(8, 4, 64), (6, 2, 32), (4, 4, 20), (4, 1, 128)])
@pytest.mark.parametrize("window", [None, 9])
def test_sinks_match_the_reference_on_every_path(dtype, tol, tiled, amx_tiles, heads, kvh, d, window):
    """gpt-oss's sinks (a logit per head with no value) on the portable, AVX2/AVX-512 and tiled
    kernels and on the torch fallback, over decodes, prefill chunks and a context past the key
    chunk; sinks both below and well above the scores (where they take most of the softmax)."""
    rng = random.Random(d * 3 + (window or 0))
    k_cache, v_cache = make_cache(200, 16, kvh, d, dtype, seed=d)
    reqs = random_requests(rng, 120, 16, n_decodes=4, n_prefills=3) + [(300, 5, list(range(120, 140)))]
    q = torch.randn(sum(n for _, n, _ in reqs), heads, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    sinks = torch.linspace(-4.0, 6.0, heads).to(dtype)
    ref = reference(q, k_cache, v_cache, reqs, d**-0.5, window, sinks)
    assert not torch.allclose(ref, reference(q, k_cache, v_cache, reqs, d**-0.5, window), atol=0.05)
    native = attend("native", q, k_cache, v_cache, reqs, heads, kvh, d, tiled, window, sinks, amx_tiles)
    fallback = attend("torch", q, k_cache, v_cache, reqs, heads, kvh, d, window=window, sinks=sinks)
    torch.testing.assert_close(native.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(fallback.double(), ref, atol=tol * 2, rtol=tol * 2)


def test_a_window_changes_the_result():
    """The reference's window is not a no-op (keys outside it do count without it)."""
    k_cache, v_cache = make_cache(20, 16, 2, 20, torch.float32, seed=0)
    reqs = [(0, 40, [1, 2, 3])]
    q = torch.randn(40, 4, 20, generator=torch.Generator().manual_seed(0))
    windowed, full = (attend("native", q, k_cache, v_cache, reqs, 4, 2, 20, window=w) for w in (7, None))
    assert torch.equal(windowed[:7], full[:7]) and not torch.allclose(windowed[7:], full[7:], atol=1e-3)
    assert not torch.allclose(reference(q, k_cache, v_cache, reqs, 20**-0.5, 7)[7:],
                              reference(q, k_cache, v_cache, reqs, 20**-0.5)[7:], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 20])
@pytest.mark.parametrize("window", [5, 16, 45])
def test_windowed_rows_do_not_depend_on_the_batch_or_the_chunking(dtype, d, window):
    """Under a window the key chunks stay aligned to absolute positions: a prompt's rows
    are the same bits whole, in chunks of 1, 7 or 64 queries (each chunk from the block of
    its first visible key on) and beside other requests."""
    heads, kvh, bs, prompt_len = 4, 2, 16, 300
    k_cache, v_cache = make_cache(100, bs, kvh, d, dtype, seed=5)
    rng = random.Random(window)
    table = rng.sample(range(1, 100), -(-prompt_len // bs))
    q_all = torch.randn(prompt_len, heads, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    whole = attend("native", q_all, k_cache, v_cache, [(0, prompt_len, table)], heads, kvh, d, window=window)
    ref = reference(q_all, k_cache, v_cache, [(0, prompt_len, table)], d**-0.5, window)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(whole.double(), ref, atol=tol, rtol=tol)
    others = [(40, 1, [1, 2, 3]), (299, 1, table), (3, 25, [4, 5])]  # a decode of the same prompt too
    q_others = torch.randn(27, heads, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    for chunk in (1, 7, 64):
        for start in range(0, prompt_len, chunk):
            n = min(chunk, prompt_len - start)
            first = max(0, start - window + 1) // bs
            mine = (start, n, [UNREADABLE] * first + table[first:])
            reqs = [others[0], others[1], mine, others[2]] if n == 1 else [others[0], others[1], others[2], mine]
            q = torch.cat([q_others[:2], q_all[start : start + n], q_others[2:]] if n == 1
                          else [q_others, q_all[start : start + n]])
            out = attend("native", q, k_cache, v_cache, reqs, heads, kvh, d, window=window)
            got = out[2 : 2 + n] if n == 1 else out[27:]
            assert torch.equal(got, whole[start : start + n]), (chunk, start)


