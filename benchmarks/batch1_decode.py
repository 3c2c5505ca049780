"""Batch-1 decode against the time to stream the weights once from memory.

A decode step of one request reads every weight once (the embedding only one row), so
its floor is the time to read those bytes from DRAM. This script measures both on this
machine, in one process: the median engine step of one request decoding (whole steps:
schedule, prepare, forward, sample), and the median time to read a buffer of the same
size with every thread (a float32 sum, which is memory-bound; a larger buffer read
before each time, so that the bytes come from DRAM, not the L3). Target: ratio <= 1.2.
With several ``--quantization`` values, each runs in turn in this process (weights kept
int8 / int4: fewer bytes to stream), and the last line gives their speed against the first.
With ``--interleave`` every model is loaded first and their steps alternate (one step of
each in turn), so that a slow minute of this machine slows all of them alike and the ratios
hold; use it where the models' weights together exceed the L3 cache (250M), since run alone
a model whose weights fit in it (int4, say) may find them there at every step, and beat its
read from DRAM.

    python benchmarks/batch1_decode.py --model dummy:llama-250m    # the defaults (dtype auto)
    python benchmarks/batch1_decode.py --model dummy:llama-250m --quantization none int8 int4
    python benchmarks/batch1_decode.py --model dummy:llama-250m --quantization none int8 int4 --interleave

With ``--llama-server BIN`` llama.cpp's server decodes one request on a model of the same shape
(../shared/peers/make_random_llama.py, bf16 GGUF; Q8_0 / Q4_0 copies for int8 / int4), and
its own per-token time (``timings.predicted_per_token_ms``) is printed beside travelator's.
travelator also decodes those very files at its defaults (a GGUF's Q8_0 / Q4_0 tensors stay
int8 / int4; ``--dtype`` and ``--kernels`` apply as given), their steps taking turns, and the
last line sets the best of each on the same files side by side: what a user who downloads one
of them gets from either server.

With ``--compare-model`` a second model decodes at the same settings, the two taking turns, and
the last line gives the first's step against the second's: a mixture of experts against the
dense model of its active size (a mixture's step reads only the experts it uses, and so does
its streaming time here):

    python benchmarks/batch1_decode.py --model dummy:qwen3-moe-1b --compare-model dummy:qwen3-0.2b
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from travelator import LLM, SamplingParams

PEERS = Path(__file__).resolve().parent.parent.parent / "shared" / "peers"
GGUF_KIND = {"none": None, "int8": "Q8_0", "int4": "Q4_0"}


def weight_bytes_per_decode(model) -> int:
    """Bytes of every weight a one-token step reads (quantized ones as stored): all of them,
    the embedding only once (as the LM head when tied, else not at all: one row of it is
    negligible), of a mixture's experts only the token's (experts_per_token of each layer's)."""
    embed = model.embed
    total = model.weight_bytes()
    if model.lm_head_weight is not embed:
        total -= embed.numel() * embed.element_size()
    for layer in model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            one = sum(_nbytes(w) for w in (experts[0].gate_up_weight, experts[0].down_weight))
            total -= (len(experts) - layer.mlp.top_k) * one
    return total


def _nbytes(weight) -> int:
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else weight.nbytes


def last_level_cache_bytes(default: int = 512 << 20) -> int:
    """The L3 caches' total size as Linux reports them, each shared group of CPUs counted
    once (``default`` where it reports none)."""
    sizes: dict[str, int] = {}
    for cache in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index3"):
        try:
            if (cache / "level").read_text().strip() != "3":
                continue
            shared = (cache / "shared_cpu_list").read_text().strip()
            size = (cache / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        sizes[shared] = int(size.rstrip("KMG")) * scale
    return sum(sizes.values()) or default


def stream_seconds(nbytes: int, repeats: int) -> float:
    """Median time to read ``nbytes`` from memory (DRAM) with every thread. Before each read
    a buffer of twice the L3 caches is read, so the timed bytes are not found in the cache: weights
    that fit in the L3 (int4, int8 of a small model) would otherwise be timed at its speed."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    evict = torch.ones(2 * last_level_cache_bytes() // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        evict.sum()
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-250m")
    ap.add_argument("--compare-model", help="a second model, its steps taking turns with --model's (see above)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--kernels", default="auto", choices=["auto", "native", "torch"])
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "int4"])
    ap.add_argument("--lm-head-quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                    help="the LM head's weights in the int8 / int4 runs (auto: int8)")
    ap.add_argument("--interleave", action="store_true",
                    help="load every model first, then alternate their steps (see above)")
    ap.add_argument("--llama-server", help="a llama-server binary: its batch-1 decode too")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="LLAMA_ARG_REPACK=0 (its Q8_0/Q4_0 repacking segfaulted on the AMX VM)")
    args = ap.parse_args()
    if args.compare_model:
        compare_models(args)
        return
    groups = [args.quantization] if args.interleave else [[q] for q in args.quantization]
    steps = {q: step for group in groups for q, step in measure(args, group).items()}
    base = args.quantization[0]
    if len(steps) > 1:
        print("batch-1 decode speed against " + base + ": "
              + ", ".join(f"{q} {steps[base] / t:.2f}x" for q, t in steps.items() if q != base))
    if args.llama_server:
        with tempfile.TemporaryDirectory() as tmp:
            files = peer_gguf_files(args, tmp)
            on_files = measure_files(args, files)
            llama = {q: llama_one_request(args, path) for q, path in files.items()}
        compare_with_llama(steps, on_files, llama)


def peer_gguf_files(args, tmp: str) -> dict[str, str]:
    """A random model of the preset's shape as a bf16 GGUF and, for each other quantization,
    its Q8_0 / Q4_0 copy: {quantization: path}."""
    from travelator.model.gguf_requantize import requantize_gguf

    preset = args.model.split("-")[-1]  # dummy:llama-250m -> 250m
    subprocess.run([sys.executable, str(PEERS / "make_random_llama.py"), preset, f"{tmp}/hf"],
                   check=True, capture_output=True)
    subprocess.run([sys.executable, str(PEERS / "hf_to_gguf.py"), f"{tmp}/hf", f"{tmp}/bf16.gguf"],
                   check=True, capture_output=True)
    files = {}
    for q in args.quantization:
        files[q] = f"{tmp}/{GGUF_KIND[q] or 'bf16'}.gguf"
        if GGUF_KIND[q]:
            requantize_gguf(f"{tmp}/bf16.gguf", files[q], GGUF_KIND[q])
    return files


def measure_files(args, files: dict[str, str]) -> dict[str, float]:
    """travelator at its defaults on each GGUF file, loaded together, their steps taking turns."""
    engines = [start_decoding(args, "auto", path) for path in files.values()]
    steps = decode_steps(args, engines)
    return {q: report(args, "auto", step, engine, Path(path).name)
            for (q, path), step, engine in zip(files.items(), steps, engines)}


def compare_with_llama(steps: dict[str, float], on_files: dict[str, float], llama: dict[str, float]) -> None:
    """Per format, then the best of each on the same files (ms per token, ms per step)."""
    for q, ms in llama.items():
        kind = GGUF_KIND[q] or "BF16"
        print(f"llama.cpp {kind}: {ms:.1f} ms per token; travelator {q}: {steps[q] * 1e3:.1f} ms per step "
              f"({ms / (steps[q] * 1e3):.2f}x llama.cpp's speed); travelator at its defaults on the {kind} GGUF: "
              f"{on_files[q] * 1e3:.1f} ms per step ({ms / (on_files[q] * 1e3):.2f}x)", flush=True)
    ours, theirs = min(on_files, key=on_files.get), min(llama, key=llama.get)
    print(f"best on the same files: travelator at its defaults {on_files[ours] * 1e3:.1f} ms per step "
          f"({GGUF_KIND[ours] or 'BF16'} GGUF), llama.cpp {llama[theirs]:.1f} ms per token "
          f"({GGUF_KIND[theirs] or 'BF16'} GGUF): {llama[theirs] / (on_files[ours] * 1e3):.2f}x llama.cpp's best",
          flush=True)


def llama_one_request(args, gguf: str, port: int = 18437) -> float:
    env = dict(os.environ, **({"LLAMA_ARG_REPACK": "0"} if args.llama_no_repack else {}))
    cmd = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(os.cpu_count()),
           "--parallel", "1", "-c", "512", "-ctk", "bf16", "-ctv", "bf16"]
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if srv.poll() is not None:
                raise SystemExit(f"llama-server exited with {srv.returncode} on {gguf}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"llama-server did not become healthy on {gguf}") from None
                time.sleep(0.5)
        per_token = []
        for _ in range(3):  # the first warms up
            body = dict(prompt=[1] + list(range(3, 18)), n_predict=args.steps + 1, ignore_eos=True,
                        temperature=0, cache_prompt=False)
            req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                per_token.append(json.loads(r.read())["timings"]["predicted_per_token_ms"])
        return statistics.median(per_token[1:])
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()


def compare_models(args) -> None:
    """--model against --compare-model at each quantization, their steps taking turns."""
    for q in args.quantization:
        engines = [start_decoding(args, q, model) for model in (args.model, args.compare_model)]
        steps = decode_steps(args, engines)
        for model, step, engine in zip((args.model, args.compare_model), steps, engines):
            report(args, q, step, engine, model)
        print(f"quantization={q}: {args.model} step / {args.compare_model} step: {steps[0] / steps[1]:.2f}",
              flush=True)


def start_decoding(args, quantization: str, model: str | None = None):
    """An engine with one request, its prompt prefilled: each later step decodes one token."""
    llm = LLM(model or args.model, dtype=args.dtype, max_num_seqs=1, kernels=args.kernels,
              enable_prefix_caching=False, quantization=quantization,
              lm_head_quantization=args.lm_head_quantization if quantization in ("int8", "int4") else "auto")
    engine = llm.engine
    engine.add_request([1] + list(range(3, 18)),
                       SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True))
    engine.step()  # the prefill
    return engine


def decode_steps(args, engines: list) -> list[float]:
    """Each engine's median step over ``args.steps`` steps, the engines taking turns."""
    times = [[] for _ in engines]
    for _ in range(args.steps):
        for engine, ts in zip(engines, times):
            t0 = time.perf_counter()
            engine.step()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def measure(args, quantizations: list[str]) -> dict[str, float]:
    """One engine per quantization, loaded together, their steps taking turns."""
    engines = [start_decoding(args, q) for q in quantizations]
    return {q: report(args, q, step, engine)
            for q, step, engine in zip(quantizations, decode_steps(args, engines), engines)}


def report(args, quantization: str, step: float, engine, model: str | None = None) -> float:
    """Prints the step against the time to read the weights it streams; returns the step."""
    nbytes = weight_bytes_per_decode(engine.runner.model)
    stream = stream_seconds(nbytes, repeats=15)
    head = f" lm_head={args.lm_head_quantization}" if quantization in ("int8", "int4") else ""
    print(f"{model or args.model} {args.dtype} quantization={quantization}{head} kernels={args.kernels}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}: batch-1 decode step "
          f"{step * 1e3:.1f} ms; reading the {nbytes / 1e6:.0f} MB of weights {stream * 1e3:.1f} ms "
          f"({nbytes / stream / 1e9:.1f} GB/s); ratio {step / stream:.2f} (target <= 1.2)", flush=True)
    return step


if __name__ == "__main__":
    main()
