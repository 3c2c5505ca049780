"""Sampling by exponential race for GPUs, in Triton: the same contract as the native CPU
kernel (``NativeOps.exponential_race``), with noise drawn on the device.

Row r draws ``argmax_j scores[r, j] - log(-log U_j)``: scores plus Gumbel noise, the same
as ``argmax_j softmax(scores[r])_j / E_j`` with ``E_j = -log U_j ~ Exp(1)``, which is a draw
from ``softmax(scores[r])``. ``U_j`` comes from Philox, a counter-based generator, keyed by
the row's seed and counted by the vocabulary index ``j``: a row's draw depends on its seed
and its scores only, never on the other rows of the batch or on the row's position.

The seed: ``tl.randint(seed, offsets)`` with 32-bit offsets casts the seed to 64 bits and
splits it into Philox's two 32-bit key words, so the whole int64 seed is the key (loaded
from a tensor: a Python int argument would be specialised to 32 bits when small, and 64-bit
signed otherwise). The counter is the 32-bit vocabulary index (vocabularies are far below
2**31 tokens).

The grid is (rows, splits): each program walks its share of a row's vocabulary in tiles of
``BLOCK`` entries, keeping the best score so far and its index, and a few torch ops on the
device pick each row's best split. A small batch splits its rows so that the GPU has enough
programs; the draw is the same for any split or tile width, because the noise is keyed by
the index. The first of equal bests wins, as in the CPU kernel. Filtered entries (-inf, or
NaN) never win; a row with nothing left returns 0.

Under ``TRITON_INTERPRET=1`` the same kernel runs on the CPU (the tests check it there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries per tile
_PROGRAMS = 512  # programs a small batch's rows are split into, to fill the GPU
# U = (top 23 bits + 1/2) / 2**23: strictly inside (0, 1) and exact in float32, so neither
# log ever sees 0 (with 24 bits the largest value rounds up to 1 and its noise to +inf).
_UNIFORM_BITS = 23


@triton.jit
def _exponential_race_kernel(best_ptr, arg_ptr, scores_ptr, seeds_ptr, vocab, stride_row, tiles_per_split,
                             BLOCK: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    seed = tl.load(seeds_ptr + row)  # int64: the Philox key
    base = scores_ptr + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    arg = tl.full([], 0, tl.int32)
    lo = split * tiles_per_split * BLOCK
    hi = tl.minimum(lo + tiles_per_split * BLOCK, vocab)
    for start in range(lo, hi, BLOCK):
        j = start + cols
        x = tl.load(base + j, mask=j < hi, other=float("-inf")).to(tl.float32)
        bits = tl.randint(seed, j)  # uint32, counted by the vocabulary index
        u = ((bits >> SHIFT).to(tl.float32) + 0.5) * SCALE
        s = tl.where(x > float("-inf"), x - tl.log(-tl.log(u)), float("-inf"))  # NaN: filtered
        tile_best = tl.max(s, 0)
        tile_arg = tl.argmax(s, 0, tie_break_left=True)
        better = tile_best > best  # strict: an earlier tile keeps a tie
        arg = tl.where(better, start + tile_arg, arg)
        best = tl.where(better, tile_best, best)
    out = row * tl.num_programs(1) + split
    tl.store(best_ptr + out, best)
    tl.store(arg_ptr + out, arg.to(tl.int64))


def exponential_race(scores: torch.Tensor, seeds: torch.Tensor, block: int = BLOCK,
                     splits: int | None = None) -> torch.Tensor:
    """Each row's draw from softmax(``scores`` [B, V] float32, contiguous), with noise from its
    seed in ``seeds`` [B] int64 alone; returns [B] int64 on the scores' device. ``block``: the
    tile width, a power of two; ``splits``: programs per row (None: enough for the GPU). The
    tests take small tiles and set splits, to cross tiles and splits."""
    if scores.dim() != 2 or not scores.is_contiguous() or scores.dtype != torch.float32:
        raise ValueError("exponential_race: contiguous float32 [B, V] scores")
    if seeds.shape != scores.shape[:1] or seeds.dtype != torch.long or seeds.device != scores.device:
        raise ValueError("exponential_race: int64 [B] seeds on the scores' device")
    rows, vocab = scores.shape
    if rows == 0 or vocab == 0:
        return torch.zeros(rows, dtype=torch.long, device=scores.device)
    tiles = triton.cdiv(vocab, block)
    splits = min(tiles, splits or triton.cdiv(_PROGRAMS, rows))
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)  # none left empty
    best = torch.empty(rows, splits, dtype=torch.float32, device=scores.device)
    arg = torch.empty(rows, splits, dtype=torch.long, device=scores.device)
    _exponential_race_kernel[(rows, splits)](
        best, arg, scores, seeds.contiguous(), vocab, scores.stride(0), tiles_per_split,
        BLOCK=block, SHIFT=32 - _UNIFORM_BITS, SCALE=2.0 ** -_UNIFORM_BITS,
    )
    if splits == 1:
        return arg.view(rows)
    # The first best split: its index is the row's first best (splits are in index order).
    return arg.gather(1, best.argmax(dim=1, keepdim=True)).view(rows)
