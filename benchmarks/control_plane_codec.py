"""Encode + decode time of one tensor-parallel step message with 64 requests: pickle (how
the step plan travelled before) against the control-plane codec, alone and sealed/opened
with its HMAC (what a step costs the driver and a worker now, outside the collectives).

    PYTHONPATH=. python benchmarks/control_plane_codec.py
"""

from __future__ import annotations

import pickle
import random
import timeit

from travelator.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from travelator.engine.tp_protocol import decode_call, encode_call
from travelator.model.tp_auth import ControlAuth, session_id
from travelator.sampling_params import SamplingParams

N = 64


def decode_step(rng: random.Random) -> tuple[SchedulerOutput, list[tuple[str, int]]]:
    """64 running requests, one token each; one in eight opens a new block."""
    cached = [CachedRequestData(f"req-{i}", [rng.randrange(4096)] if i % 8 == 0 else [], rng.randrange(64, 2048))
              for i in range(N)]
    out = SchedulerOutput(cached_requests=cached, num_scheduled_tokens={c.request_id: 1 for c in cached},
                          num_decodes=N)
    return out, [(c.request_id, rng.randrange(32000)) for c in cached]


def prefill_step(rng: random.Random) -> tuple[SchedulerOutput, list[tuple[str, int]]]:
    """64 new requests of 128 prompt tokens, sampled with their own parameters."""
    new = [NewRequestData(f"req-{i}", [rng.randrange(32000) for _ in range(128)], [],
                          SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=256, stop=["\n\n"]),
                          [rng.randrange(4096) for _ in range(8)], 0) for i in range(N)]
    out = SchedulerOutput(new_requests=new, num_scheduled_tokens={r.request_id: 128 for r in new},
                          num_prefill_tokens=128 * N, prefill_request_ids=[r.request_id for r in new])
    return out, []


def main() -> None:
    rng = random.Random(0)
    sender = ControlAuth(b"k" * 32, 0, 2, session_id([b"a" * 16, b"b" * 16]))
    receiver = ControlAuth(b"k" * 32, 1, 2, session_id([b"a" * 16, b"b" * 16]))
    for name, (out, sampled) in (("decode", decode_step(rng)), ("prefill", prefill_step(rng))):
        msg = ("step", (out, sampled), False)

        def old() -> None:
            pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

        def new() -> None:
            decode_call(encode_call("step", (out, sampled)))

        def sealed() -> None:
            decode_call(receiver.open(0, sender.seal(encode_call("step", (out, sampled)))))

        size_old = len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        size_new = len(encode_call("step", (out, sampled)))
        for label, fn, size in (("pickle", old, size_old), ("codec", new, size_new),
                                ("codec+hmac", sealed, size_new + 40)):
            n, total = timeit.Timer(fn).autorange()
            best = min(timeit.repeat(fn, number=n, repeat=5)) / n
            print(f"{name:8s} {N} requests  {label:11s} {best * 1e6:8.1f} us per step  {size:7d} bytes")


if __name__ == "__main__":
    main()
