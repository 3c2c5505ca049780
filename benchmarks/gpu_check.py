"""The device check: what a short loan of an NVIDIA GPU should measure, in one run.

    python benchmarks/gpu_check.py            # about two minutes; prints one table

Needs only this checkout, torch with CUDA and triton (nothing is downloaded). It runs:

1. the Triton kernels' tests compiled for the GPU (``tests/kernels/test_triton_attention.py``
   and ``test_triton_sampling.py`` pick the GPU when there is one), so a kernel that the
   interpreter accepts but the compiler rejects, or that computes differently with tensor
   cores, shows here; with them the sampler's device-path tests (one fails on any host
   synchronisation while it samples) and the tests of the staged step inputs and of the
   decode steps' CUDA graphs, whose ``cuda``-marked cases (pinned buffers, recorded graphs)
   run only on a GPU;
2. the GPU's copy bandwidth (1 GiB copied device to device: 2 GiB moved), the bound of every
   memory-bound figure below;
3. the paged attention of a Llama-3-8B-shaped layer (32 query heads, 8 KV heads, head size
   128, bf16, blocks of 16 shuffled over the pool): a decode step of 64 requests x 1k
   context, the same at 8k context (the split over keys), and a mixed step of 4 prefill
   chunks of 512 beside 60 decodes; each as time per call and as the share of the copy
   bandwidth its KV reads reach;
4. the sampler's exponential race over 64 rows of a 128k vocabulary.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
GPU_TESTS = ("tests/kernels/test_triton_attention.py", "tests/kernels/test_triton_sampling.py",
             "tests/model/test_sampler_device_path.py", "tests/engine/test_step_staging.py",
             "tests/engine/test_decode_graphs.py")


def timed(fn, repeats: int = 20) -> float:
    """Median seconds of ``fn()`` on the GPU, by CUDA events, after two warm-up calls."""
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes moved per second by a 1 GiB device-to-device copy (read plus write)."""
    import torch

    src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * GIB / timed(lambda: dst.copy_(src))


def attention_case(context: int, decodes: int, prefill_chunks: int, chunk: int) -> dict:
    """One paged-attention call of a Llama-3-8B layer over a shuffled block pool."""
    import torch

    from travelator.kernels import triton_attention
    from travelator.model.attention import build_metadata

    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    query_lens = [1] * decodes + [chunk] * prefill_chunks
    seq_lens = [context + n for n in query_lens]
    need = [-(-s // block_size) for s in seq_lens]
    blocks = list(range(sum(need)))
    random.Random(0).shuffle(blocks)
    tables, at = [], 0
    for n in need:
        tables.append(blocks[at:at + n])
        at += n
    cache_shape = (len(blocks), kv_heads, block_size, head_dim)
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(query_lens), heads, head_dim, dtype=torch.bfloat16, device="cuda")
    meta = build_metadata("triton", torch.empty(0, dtype=torch.long), query_lens,
                          [context] * len(query_lens), tables, block_size, torch.device("cuda"))
    args = (q, k_cache, v_cache, meta.query_start, meta.seq_lens, meta.block_tables,
            head_dim**-0.5, 0, meta.max_query_len, meta.max_seq_len)
    seconds = timed(lambda: triton_attention.paged_attention(*args))
    kv_bytes = sum(seq_lens) * kv_heads * head_dim * 2 * 2  # keys and values, bf16
    return dict(seconds=seconds, kv_bytes=kv_bytes)


def race_seconds(rows: int, vocab: int) -> float:
    """One call of the Triton exponential race (the sampler's draw) on float32 scores."""
    import torch

    from travelator.kernels import triton_sampling

    scores = torch.randn(rows, vocab, device="cuda")
    seeds = torch.arange(rows, device="cuda")
    return timed(lambda: triton_sampling.exponential_race(scores, seeds))


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here")
    rows = [("GPU", torch.cuda.get_device_name()), ("torch", torch.__version__)]
    import triton

    rows.append(("triton", triton.__version__))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", *GPU_TESTS],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    rows.append(("Triton, staging and graph tests on the GPU", tests.stdout.strip().splitlines()[-1]))
    bandwidth = copy_bandwidth()
    rows.append(("copy bandwidth", f"{bandwidth / 1e12:.2f} TB/s"))
    for name, case in [("decode 64 x 1k context", (1024, 64, 0, 0)),
                       ("decode 64 x 8k context (split keys)", (8192, 64, 0, 0)),
                       ("mixed: 60 decodes x 1k + 4 chunks of 512", (1024, 60, 4, 512))]:
        got = attention_case(*case)
        share = got["kv_bytes"] / got["seconds"] / bandwidth
        rows.append((f"attention, {name}", f"{got['seconds'] * 1e6:.0f} us, "
                                            f"{share:.0%} of copy bandwidth on its KV reads"))
    rows.append(("exponential race, 64 rows x 128k vocab", f"{race_seconds(64, 128 * 1024) * 1e6:.0f} us"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if tests.returncode != 0:
        print(tests.stdout[-3000:], tests.stderr[-2000:], sep="\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
