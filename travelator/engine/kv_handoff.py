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

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from travelator.config import EngineConfig
    from travelator.engine.executor import Executor
    from travelator.engine.block_manager import KVCacheManager
    from travelator.engine.outputs import RequestOutput
    from travelator.engine.request import Request
    from travelator.engine.scheduler import SchedulerBase

logger = logging.getLogger(__name__)


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


class KVHandoffs:
    """The engine's side of hand-offs: it marks a request to hand off, reads the KV of those
    that finished their part out of the pool, and places another engine's hand-off into
    blocks of this pool."""

    def __init__(self, config: EngineConfig, scheduler: SchedulerBase, kv: KVCacheManager,
                 runner: Executor) -> None:
        self._config = config
        self._scheduler = scheduler
        self._kv = kv
        self._runner = runner

    def prepare(self, req: Request) -> None:
        """Make a request from make_request stop after its first token and hand its KV over."""
        if self._config.scheduler.speculative_method == "draft":
            raise ValueError("a KV hand-off does not carry a draft model's cache")
        if self._config.parallel.tensor_parallel_size > 1:
            raise ValueError("a KV hand-off needs tensor_parallel_size 1")
        if req.max_tokens > 1:
            req.hand_off = True
            req.max_tokens = 1

    def attach(self, outputs: list[RequestOutput]) -> None:
        """Read out the KV of the requests that finished their part here this step, and
        attach it to their outputs (or, where the read failed, the error)."""
        handoffs = self._read_finished()
        if not handoffs:
            return
        for o in outputs:  # not when a stop string ended it at its first token
            h = handoffs.get(o.request_id)
            if isinstance(h, str):
                o.finish_reason, o.error = "error", h
            elif h is not None and o.finish_reason == "length":
                o.handoff = h

    def _read_finished(self) -> dict[str, KVHandoff | str]:
        """Read out the KV of requests that finished their part here, then free their blocks
        (full ones stay in the prefix cache). A read that fails gives that request's error."""
        done: dict[str, KVHandoff | str] = {}
        for req in self._scheduler.take_handoffs():
            rid = req.request_id
            try:
                done[rid] = KVHandoff(rid, list(req.prompt_token_ids), list(req.output_token_ids),
                                      req.num_computed_tokens, self._kv.block_size,
                                      self._runner.read_kv_blocks(self._kv.block_ids(rid)), req.cache_salt)
            except Exception as exc:  # noqa: BLE001 - fail this request, not the step loop
                logger.exception("reading the KV of %s for its hand-off failed", rid)
                done[rid] = f"the KV hand-off failed: {exc!r}"
            finally:
                self._kv.free(rid)
        return done

    def place(self, handoff: KVHandoff, req: Request) -> None:
        """Give ``req`` (made from the hand-off) its outputs and blocks here, filled with the
        hand-off's KV. Raises KVPoolFullError, changing nothing, when the pool has no room."""
        if handoff.block_size != self._kv.block_size:
            raise ValueError(f"handed-off blocks hold {handoff.block_size} tokens, this pool's {self._kv.block_size}")
        if handoff.kv_layout != KV_LAYOUT:
            raise ValueError(f"handed-off blocks are laid out as [{handoff.kv_layout}], this pool's as "
                             f"[{KV_LAYOUT}]: both engines must run the same version")
        outputs = list(handoff.output_token_ids)
        if not outputs or len(outputs) >= req.max_tokens:
            raise ValueError("a hand-off continues a request that has sampled at least one token and "
                             "has more to sample")
        if handoff.num_computed_tokens != req.num_tokens + len(outputs) - 1:
            raise ValueError("a hand-off must hold the KV of every token but the last sampled")
        if req.request_id in self._scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.output_token_ids = outputs
        if self._kv.allocate_slots(req, handoff.num_computed_tokens) is None:
            raise KVPoolFullError(f"no room for {handoff.num_computed_tokens} tokens of KV now")
        try:
            self._runner.write_kv_blocks(self._kv.block_ids(req.request_id), handoff.kv)
        except Exception:
            self._kv.free(req.request_id)
            raise
        req.num_computed_tokens = handoff.num_computed_tokens
