"""KV hand-offs between processes: torch.distributed point-to-point on a gloo group.

A prefill worker sends each ``KVHandoff`` to a decode worker: a small header (the request's
tokens and the data's shape, as JSON: nothing received is unpickled) and then the K/V one layer at a time, every send
queued at once so that gloo moves a layer while the next is handed over. The receiver
allocates each layer's buffer from the header. The group is built from a store, with no
process-wide default group, as the tensor-parallel group (``model/tp_group.py``) is. Across
hosts, each end binds gloo to the address its peer reaches it at (``host``); without one, gloo
picks its interface itself (``GLOO_SOCKET_IFNAME``, else what the hostname resolves to).
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from travelator.engine.kv_handoff import OLD_KV_LAYOUT, KVHandoff

_TAG_SIZE, _TAG_HEADER, _TAG_LAYER0 = 0, 1, 2
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": torch.int8}  # int8: the int8 KV cache's rows (codes and scale bytes)


@dataclass(slots=True)
class TransferStats:
    handoffs: int = 0
    bytes: int = 0
    seconds: float = 0.0


class KVChannel:
    """This process's end of the hand-off group: ``rank`` of ``size`` ranks."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float = 600.0,
                 host: str | None = None) -> None:
        self.rank = rank
        self.size = size
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore("kv/", store)
        if host is None:
            self.group = dist.ProcessGroupGloo(store, rank, size, timeout)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self.group = dist.ProcessGroupGloo(store, rank, size, options)
        self.sent = TransferStats()
        self.received = TransferStats()

    def send(self, handoff: KVHandoff, dst: int) -> None:
        """Send a hand-off to rank ``dst``; returns once gloo has sent every part."""
        t0 = time.perf_counter()
        kv = handoff.kv
        header = json.dumps({
            "request_id": handoff.request_id, "prompt_token_ids": handoff.prompt_token_ids,
            "output_token_ids": handoff.output_token_ids,
            "num_computed_tokens": handoff.num_computed_tokens, "block_size": handoff.block_size,
            "cache_salt": handoff.cache_salt, "kv_layout": handoff.kv_layout,
            "shape": list(kv.shape), "dtype": str(kv.dtype).removeprefix("torch."),
        }).encode()
        data = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        works = [self.group.send([torch.tensor([len(header)], dtype=torch.long)], dst, _TAG_SIZE),
                 self.group.send([data], dst, _TAG_HEADER)]
        layers = [kv[layer].contiguous() for layer in range(kv.shape[0])]
        works += [self.group.send([t], dst, _TAG_LAYER0 + i) for i, t in enumerate(layers)]
        for w in works:
            w.wait()
        self.sent.handoffs += 1
        self.sent.bytes += handoff.nbytes
        self.sent.seconds += time.perf_counter() - t0

    def recv(self, src: int) -> KVHandoff:
        """The next hand-off rank ``src`` sends (blocks until it has arrived whole)."""
        size = torch.empty(1, dtype=torch.long)
        self.group.recv([size], src, _TAG_SIZE).wait()
        t0 = time.perf_counter()  # from the first byte: not the time spent waiting for work
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        self.group.recv([buf], src, _TAG_HEADER).wait()
        head = json.loads(buf.numpy().tobytes())
        shape, dtype = head["shape"], _DTYPES[head["dtype"]]
        layers = [torch.empty(shape[1:], dtype=dtype) for _ in range(shape[0])]
        works = [self.group.recv([t], src, _TAG_LAYER0 + i) for i, t in enumerate(layers)]
        for w in works:
            w.wait()
        kv = torch.stack(layers) if layers else torch.empty(shape, dtype=dtype)
        # A sender from before the layout was named sent the old one.
        handoff = KVHandoff(head["request_id"], head["prompt_token_ids"], head["output_token_ids"],
                            head["num_computed_tokens"], head["block_size"], kv, head["cache_salt"],
                            head.get("kv_layout", OLD_KV_LAYOUT))
        self.received.handoffs += 1
        self.received.bytes += handoff.nbytes
        self.received.seconds += time.perf_counter() - t0
        return handoff
