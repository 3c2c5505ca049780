"""The paged-attention kernel on prompt chunks: the route the defaults take against the
row-wise kernel of batch-invariant mode, and against torch's SDPA on dense copies.

One layer's attention (16 heads over 8 KV heads, head_dim 64, blocks of 16 shuffled, bf16) for
a step of prompt chunks: several whole prompts of one length, or one later chunk of a long
prompt (its keys before the chunk already cached). The defaults' route (`tiled`) takes prompt
tiles to the tiled kernel, whose products run on AMX's tiles where there are
(travelator/kernels/csrc/attention_tiles_amx.h), and chunks of many rows over long contexts to
ATen's flash attention on AMX CPUs (attention_flash.h); batch-invariant mode takes the
row-wise kernel. SDPA runs on contiguous [prompts, heads, length, 64] copies (whole prompts
only). With `--against REV`, the same route as another git revision's kernel has it (its
paged_attention.cpp built beside this one's, the two called in the same process). Medians of 7
calls.

    python benchmarks/prefill_attention.py
    python benchmarks/prefill_attention.py --against 227c503   # the tiled kernel before flash
    python benchmarks/prefill_attention.py --against 365f37d   # before the products on the tiles
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from bench_timing import median_seconds

from travelator import kernels
from travelator.kernels import _LDFLAGS, _cflags
from travelator.model import kv_layout

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16
# (prompts, query rows each, keys each: the rows are the last of those keys)
SHAPES = [(32, 64, 64), (16, 128, 128), (14, 150, 150), (8, 256, 256), (4, 512, 512), (2, 1024, 1024), (1, 2048, 2048), (1, 2048, 4096)]


ROOT = Path(__file__).resolve().parent.parent
CSRC = "travelator/kernels/csrc/"


def kernel_at(revision: str) -> Callable[..., torch.Tensor]:
    """paged_attention as `revision` builds it: its kernel sources written out, the op renamed,
    built as a second extension with the package's own compiler flags."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout

    tag = re.sub(r"\W", "_", revision)
    out = Path(tempfile.mkdtemp(prefix="prefill-attention-"))
    for name in git("ls-tree", "--name-only", revision, CSRC).split():
        (out / Path(name).name).write_text(git("show", f"{revision}:{name}"))
    source = out / "paged_attention.cpp"
    source.write_text(source.read_text().replace("TORCH_LIBRARY(travelator,", f"TORCH_LIBRARY(at_{tag},"))
    load(f"paged_attention_at_{tag}", [str(source)], extra_cflags=list(_cflags()),
         extra_ldflags=list(_LDFLAGS), extra_include_paths=[str(out)], is_python_module=False)
    return getattr(torch.ops, f"at_{tag}").paged_attention


def report(prompts: int, rows: int, keys: int, before: Callable[..., torch.Tensor] | None, revision: str) -> str:
    blocks_each = -(-keys // BLOCK)
    shape = kv_layout.cache_shape(prompts * blocks_each, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16)
    k_cache, v_cache = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()
    table = torch.randperm(prompts * blocks_each).view(prompts, blocks_each)
    q = torch.randn(prompts * rows, HEADS, HEAD_DIM).bfloat16()
    query_start = torch.arange(prompts + 1) * rows
    seq_lens = torch.full((prompts,), keys)
    flops = prompts * HEADS * (keys * keys - (keys - rows) ** 2) / 2 * HEAD_DIM * 4  # causal: half the scores

    def attend(tiled: bool, kernel: Callable[..., torch.Tensor] = torch.ops.travelator.paged_attention):
        return kernel(q, k_cache, v_cache, query_start, seq_lens, table, HEAD_DIM**-0.5, tiled)

    times = {"defaults (tiled)": median_seconds(lambda: attend(True), 7)}
    if before is not None:
        times[f"at {revision} (tiled)"] = median_seconds(lambda: attend(True, before), 7)
    times["row-wise (batch-invariant)"] = median_seconds(lambda: attend(False), 7)
    if rows == keys:
        qd = q.view(prompts, rows, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        kd, vd = (torch.randn(prompts, KV_HEADS, keys, HEAD_DIM).bfloat16() for _ in range(2))
        times["torch SDPA"] = median_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True, enable_gqa=True), 7)
    cells = [f"{name} {s * 1e3:.2f} ms ({flops / s / 1e9:.0f} GFLOP/s)" for name, s in times.items()]
    return f"{prompts} x {rows} rows at {keys} keys: " + ", ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", metavar="REV", help="also time the kernel of this git revision")
    args = parser.parse_args()
    kernels.load()
    before = kernel_at(args.against) if args.against else None
    torch.manual_seed(0)
    for shape in SHAPES:
        print(report(*shape, before, args.against), flush=True)


if __name__ == "__main__":
    main()
