"""What a KV hand-off costs: reading a request's blocks out of the prefill engine, moving them
to a decode process over gloo, writing them into the decode engine's pool, against the
prefill itself.

    python benchmarks/kv_handoff.py --model dummy:llama-50m --prompt-lens 256 1536
    python benchmarks/kv_handoff.py --across-namespaces   # as root: the decode side on another "host"

Two processes (rank 0 prefills, rank 1 decodes), each with its own engine; per prompt length,
the median of ``--repeats`` hand-offs. By default both run on this machine over loopback; with
``--across-namespaces`` each runs in its own network namespace, the two joined by a veth pair
(``tests/two_hosts.py``), and gloo binds each side's address on that link, as across hosts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _worker(rank: int, store_host: str, port: int, bind: str | None, args: argparse.Namespace) -> list[tuple]:
    import torch.distributed as dist

    from travelator import LLM, SamplingParams
    from travelator.disagg.kv_transport import KVChannel

    store = dist.TCPStore(store_host, port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
    channel = KVChannel(store, rank, 2, host=bind)
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
    return rows


def _options(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--dtype", args.dtype, "--repeats", str(args.repeats),
            "--prompt-lens", *map(str, args.prompt_lens)]


def _run_pair(args: argparse.Namespace) -> dict[int, list]:
    """Both ranks as child processes of this script (``--rank``), each printing its rows."""
    from travelator.server.process import free_port

    me = [sys.executable, str(Path(__file__).resolve())]
    if not args.across_namespaces:
        port = free_port()
        argvs = [[*me, "--rank", str(r), "--store", f"127.0.0.1:{port}", *_options(args)] for r in (0, 1)]
        return _collect(argvs)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from two_hosts import two_hosts

    with two_hosts() as (first, second):
        store = f"{first.address}:29501"
        argvs = [h.command([*me, "--rank", str(r), "--store", store, "--bind", h.address, *_options(args)])
                 for r, h in enumerate((first, second))]
        received = second.link_bytes()[0]
        got = _collect(argvs)
        print(f"bytes received on the decode side's link: {second.link_bytes()[0] - received}")
        return got


def _collect(argvs: list[list[str]]) -> dict[int, list]:
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, text=True) for a in argvs]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    return {r: json.loads(out.strip().splitlines()[-1]) for r, out in enumerate(outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-50m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 1536])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--across-namespaces", action="store_true",
                    help="the decode side in another network namespace, over a veth pair (needs root)")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a child: one side
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bind", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        host, port = args.store.rsplit(":", 1)
        print(json.dumps(_worker(args.rank, host, int(port), args.bind, args)))
        return

    got = _run_pair(args)
    where = "across two network namespaces (veth)" if args.across_namespaces else "on one machine (loopback)"
    print(f"{args.model} {args.dtype}, {where}, medians of {args.repeats} hand-offs per prompt length")
    print("| prompt tokens | KV MB | prefill, read included (ms) | read (ms) | send (ms) | receive (ms) "
          "| write (ms) | receive (ms/MB) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.prompt_lens:
        sent = [r for r in got[0] if r[0] == n]
        recv = [r for r in got[1] if r[0] == n]
        med = lambda xs: statistics.median(xs) * 1000  # noqa: E731
        mb = sent[0][1] / 1e6
        print(f"| {n} | {mb:.1f} | {med([r[2] for r in sent]):.0f} | {med([r[3] for r in sent]):.1f} "
              f"| {med([r[4] for r in sent]):.1f} | {med([r[1] for r in recv]):.1f} | {med([r[2] for r in recv]):.1f} "
              f"| {med([r[1] for r in recv]) / mb:.2f} |")


if __name__ == "__main__":
    main()
