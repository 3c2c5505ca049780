"""A request's computed KV cache, taken out of one engine to continue in another: the
unit of prefill/decode disaggregation (DistServe).

The prefill engine computes a request's prompt and samples its first token; instead of
freeing the request's blocks it reads them out (``KVHandoff``) and then frees them (full
blocks stay in its prefix cache). The decode engine allocates blocks of its own, writes
the data in, and the request joins its queue as a decode, holding those blocks: it never
computes the prompt again. Block ids differ between the two pools; only the block
contents, in the request's order, travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# The order of a layer's K or V cache dimensions (model/kv_layout.py's cache_shape), named in
# a hand-off so that an engine never reads another's blocks in another order.
KV_LAYOUT = "blocks, kv_heads, block_size, row"
# Before 2026-12-04, and what a hand-off that names none was sent in.
OLD_KV_LAYOUT = "blocks, block_size, kv_heads, row"


@dataclass(slots=True)
class KVHandoff:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # sampled by the prefill engine (the first token)
    num_computed_tokens: int  # tokens whose K/V the data holds: the prompt
    block_size: int
    # [num_layers, 2 (K, V), num_blocks, num_kv_heads, block_size, row (model/kv_layout.py)], the request's
    # blocks in its own order; slots past num_computed_tokens are unspecified.
    kv: "torch.Tensor"
    cache_salt: str | None = None  # the request's prefix-cache salt, kept on the decode side
    kv_layout: str = KV_LAYOUT  # the order of kv's dimensions after the first two

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class KVPoolFullError(RuntimeError):
    """The decode engine has no room for a handed-off request now; try again after a step."""
