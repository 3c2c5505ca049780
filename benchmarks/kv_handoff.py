"""What a KV hand-off costs: reading a request's blocks out of the prefill engine, moving them
to a decode process over gloo, writing them into the decode engine's pool, against the
prefill itself.

    python benchmarks/kv_handoff.py --model dummy:llama-50m --prompt-lens 256 1536

Two processes on this machine (rank 0 prefills, rank 1 decodes), each with its own engine;
per prompt length, the median of ``--repeats`` hand-offs.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import statistics
import time

import numpy as np


def _worker(rank: int, port: int, args: argparse.Namespace, results) -> None:
    import torch.distributed as dist

    from travelator import LLM, SamplingParams
    from travelator.disagg.kv_transport import KVChannel

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=300))
    channel = KVChannel(store, rank, 2)
    engine = LLM(args.model, dtype=args.dtype, max_model_len=max(args.prompt_lens) + 16,
                 enable_prefix_caching=False).engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(0)
    rows = []
    for n in args.prompt_lens:
        for _ in range(args.repeats):
            if rank == 0:
                prompt = rng.integers(3, engine.arch.vocab_size, size=n).tolist()
                engine.add_request(prompt, params, hand_off=True)
                t0 = time.perf_counter()
                outs = []
                while engine.has_unfinished_requests():  # the prompt (chunked), then the read
                    outs += engine.step()
                step_s = time.perf_counter() - t0
                (handoff,) = [o.handoff for o in outs if o.handoff is not None]
                blocks = list(range(handoff.kv.shape[2]))
                t0 = time.perf_counter()
                engine.runner.read_kv_blocks(blocks)  # the read alone, on blocks of the same count
                read_s = time.perf_counter() - t0
                before = channel.sent.seconds
                channel.send(handoff, dst=1)
                rows.append((n, handoff.nbytes, step_s, read_s, channel.sent.seconds - before))
            else:
                before = channel.received.seconds
                handoff = channel.recv(src=0)
                recv_s = channel.received.seconds - before
                t0 = time.perf_counter()
                req = engine.add_handoff(handoff, params)
                write_s = time.perf_counter() - t0
                engine.abort_request([req.request_id])
                rows.append((n, recv_s, write_s))
    results.put((rank, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-50m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 1536])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from travelator.server.process import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, args, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    print(f"{args.model} {args.dtype}, medians of {args.repeats} hand-offs per prompt length")
    print("| prompt tokens | KV MB | prefill, read included (ms) | read (ms) | send (ms) | receive (ms) | write (ms) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.prompt_lens:
        sent = [r for r in got[0] if r[0] == n]
        recv = [r for r in got[1] if r[0] == n]
        med = lambda xs: statistics.median(xs) * 1000  # noqa: E731
        print(f"| {n} | {sent[0][1] / 1e6:.1f} | {med([r[2] for r in sent]):.0f} | {med([r[3] for r in sent]):.1f} "
              f"| {med([r[4] for r in sent]):.1f} | {med([r[1] for r in recv]):.1f} | {med([r[2] for r in recv]):.1f} |")


if __name__ == "__main__":
    main()
