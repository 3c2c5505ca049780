"""The device check: what a short loan of an NVIDIA GPU should measure, in one run.

    python benchmarks/gpu_check.py              # on a CUDA GPU: under 8 minutes, one table
    python benchmarks/gpu_check.py --cpu-smoke  # every section on the CPU at tiny shapes

Needs only this checkout, torch with CUDA and triton (nothing is downloaded; transformers for
its baseline). It prints one table: each check, the measured figure, the target and a verdict
(pass, FAIL, error with the exception's message, skipped). Each section is guarded: one that
fails leaves the others to run, and past the time budget (``--budget``, 440 s) the remaining
sections are skipped with a note. The sections:

1. tests, started first and run beside the engine's start-up: the GPU test files (the Triton
   kernels compiled for the GPU, the sampler's device path, the staged step inputs, the decode
   steps' CUDA graphs), and ``pytest -m cuda`` over every test file that marks a test ``cuda``
   (found by text search: collecting all of tests/ took minutes on the CPU hosts). Target:
   every test passes;
2. the GPU's copy bandwidth (1 GiB copied device to device: 2 GiB moved), and as before the
   paged attention of a Llama-3-8B layer (64 decodes at 1k and 8k context, a mixed step of 4
   prefill chunks of 512 beside 60 decodes; share of the copy bandwidth its KV reads reach) and
   the sampler's exponential race over 64 rows of a 128k vocabulary: figures, no targets;
3. an engine of ``dummy:llama-8b`` (the Llama-3-8B shape, bf16, kernels auto: Triton on CUDA;
   256 requests a step, 4096 tokens a step, context 2048, a 16 GiB KV pool), shared by the
   sections below; its random weights are drawn on the GPU;
4. batch-1 decode: the median engine step of one request decoding against the time to stream
   the weights a decode step reads once at the copy bandwidth. Target <= 1.3x;
5. a decode step of 64 requests at 1k context against one of 64 requests at context ~0 (one-
   token prompts: a bare forward of 64 tokens through the same engine). Target <= 1.5x;
6. workload W scaled to 512 requests (prompts U[16,256], outputs U[8,256] forced, ids
   U[100,30000], seed 0: ../shared/peers/workload_w.py's recipe, repeated here) through the
   engine, against transformers' ``generate`` on a random-init ``LlamaForCausalLM`` of the same
   shape built on the GPU in bf16 (``bench throughput --hf-baseline`` builds it on the host,
   slow at this size), in padded static batches of 128; transformers runs the batches it
   can in ``hf_seconds`` and its time for all is extrapolated by decode steps (the row says
   how many ran). Target >= 10x;
7. the Orca comparison: static batching against iteration-level scheduling, same model and
   settings (a second engine, static), 48 W-shaped requests (seed 1) on Poisson arrivals at
   0.25, 0.5, 1 and 2 times the iteration engine's capacity (its requests a second with all 48
   present at once); the throughput each sustains at the latency target (twice the lowest
   median normalised latency), as ``travelator bench compare`` computes it. Target >= 3x.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
GPU_TESTS = ("tests/kernels/test_triton_attention.py", "tests/kernels/test_triton_sampling.py",
             "tests/model/test_sampler_device_path.py", "tests/engine/test_step_staging.py",
             "tests/engine/test_decode_graphs.py")
W_RECIPE = dict(prompt=(16, 256), output=(8, 256), ids=(100, 30000))
ORCA_NEED_S = 120  # the Orca section's estimated seconds: transformers leaves them to it


@dataclass(frozen=True)
class Plan:
    """Every size a run uses: the GPU's, or the CPU smoke run's tiny ones."""

    device: str
    model: str
    gpu_tests: tuple[str, ...]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    kv_cache_bytes: int = 16 * GIB
    copy_bytes: int = GIB
    attention: tuple = ((1024, 64, 0, 0), (8192, 64, 0, 0), (1024, 60, 4, 512))
    race: tuple[int, int] = (64, 128 * 1024)
    batch1_steps: int = 48
    wide: tuple[int, int, int] = (64, 1024, 16)  # requests, context, timed steps
    w_requests: int = 512
    w_recipe: dict = field(default_factory=lambda: W_RECIPE)
    hf_batch: int = 128
    hf_seconds: float = 60.0
    orca_requests: int = 48
    orca_rate_shares: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    tests_timeout: float = 240.0
    budget: float = 440.0


GPU_PLAN = Plan("cuda", "dummy:llama-8b", GPU_TESTS)
SMOKE_PLAN = Plan(
    "cpu", "dummy:tiny", ("tests/kernels/test_triton_sampling.py",), max_num_seqs=8,
    max_num_batched_tokens=256, max_model_len=256, kv_cache_bytes=64 << 20, copy_bytes=64 << 20,
    attention=((32, 2, 0, 0), (16, 1, 1, 16)), race=(2, 1000), batch1_steps=4, wide=(4, 64, 3),
    w_requests=6, w_recipe=dict(prompt=(16, 48), output=(8, 24), ids=(3, 1000)), hf_batch=4,
    hf_seconds=0.0, orca_requests=6, orca_rate_shares=(0.3, 1.0), budget=600.0)


@dataclass
class Row:
    check: str
    measured: str
    target: str = ""
    verdict: str = ""  # pass, FAIL, error, skipped; empty for a figure without a target
    output: str = ""  # a failed test run's output, printed under the table


class Skipped(Exception):
    """A section not run: too little of the time budget is left."""


@dataclass
class Check:
    """One run's state: its plan, clock, rows and the engines the sections share."""

    plan: Plan
    rows: list[Row] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # printed under the table
    start: float = field(default_factory=time.monotonic)
    llm: Any = None
    bandwidth: float | None = None

    def left(self) -> float:
        return self.plan.budget - (time.monotonic() - self.start)

    def need(self, seconds: float) -> None:
        if self.left() < seconds:
            raise Skipped(f"skipped: {self.left():.0f} s of the {self.plan.budget:.0f} s budget "
                          f"left, it needs about {seconds:.0f} s")

    def add(self, *args: str) -> None:
        self.rows.append(Row(*args))


def guarded(check: Check, name: str, need_s: float, fn: Callable[[Check], None]) -> None:
    """Run one section; a failure or a skip becomes its row, and the run goes on. Its rows go
    to stderr as soon as they are known, so that a run cut short still shows them."""
    first = len(check.rows)
    print(f"gpu_check [{time.monotonic() - check.start:.0f} s] {name}", file=sys.stderr, flush=True)
    try:
        check.need(need_s)
        fn(check)
    except Skipped as exc:
        check.add(name, str(exc), "", "skipped")
    except Exception as exc:  # one section's failure must not hide the others' figures
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
        check.add(name, text[:240], "", "error")
    for row in check.rows[first:]:
        print(f"    {row.check}: {row.measured} {row.target} {row.verdict}".rstrip(),
              file=sys.stderr, flush=True)


def judge(value: float, op: str, bound: float) -> str:
    ok = value <= bound if op == "<=" else value >= bound
    return "pass" if ok else "FAIL"


def target_row(check: Check, name: str, ratio: float, op: str, bound: float, text: str) -> None:
    check.add(name, f"{ratio:.2f}x: {text}", f"{op} {bound:g}x", judge(ratio, op, bound))


def format_table(rows: list[Row]) -> str:
    head = Row("check", "measured", "target", "result")
    cols = [[r.check, r.measured, r.target, r.verdict] for r in [head, *rows]]
    widths = [max(len(c[i]) for c in cols) for i in range(3)]
    lines = [f"{c[0]:<{widths[0]}}  {c[1]:<{widths[1]}}  {c[2]:<{widths[2]}}  {c[3]}".rstrip()
             for c in cols]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def exit_status(rows: list[Row], smoke: bool) -> int:
    """1 where a row failed; a smoke run fails only on errors (tiny CPU shapes miss targets)."""
    bad = ("error",) if smoke else ("error", "FAIL")
    return int(any(r.verdict in bad for r in rows))


# ---- workload W ------------------------------------------------------------------------------
def workload_w(seed: int = 0, n: int = 64, recipe: dict = W_RECIPE) -> list[tuple[list[int], int]]:
    """../shared/peers/workload_w.py's generator (the same draws in the same order), which the
    GPU host may not have: (prompt ids, output length) per request."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        p = rng.randint(*recipe["prompt"])
        o = rng.randint(*recipe["output"])
        work.append(([rng.randint(*recipe["ids"]) for _ in range(p)], o))
    return work


# ---- timing ----------------------------------------------------------------------------------
def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, repeats: int = 20) -> float:
    """Median seconds of ``fn()`` after two warm-up calls: by CUDA events on the GPU."""
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# ---- 1. tests ---------------------------------------------------------------------------------
def cuda_marked_files() -> list[str]:
    """Every test file that marks a test ``cuda``."""
    return sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")
                  if "mark.cuda" in p.read_text(encoding="utf-8"))


def run_tests(plan: Plan) -> list[Row]:
    """The GPU test files, then ``-m cuda`` over the files that mark cuda tests; in order."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if plan.device == "cuda":
        env.pop("TRITON_INTERPRET", None)
    runs = [("GPU test files (Triton, sampler, staging, graphs)", list(plan.gpu_tests)),
            ("pytest -m cuda (every cuda-marked test)", ["-m", "cuda", *cuda_marked_files()])]
    deadline = time.monotonic() + plan.tests_timeout
    rows = []
    for name, args in runs:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rows.append(Row(name, f"timed out after {plan.tests_timeout:.0f} s", "all pass", "error"))
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()] or ["(no output)"]
        ok = proc.returncode == 0
        rows.append(Row(name, lines[-1].strip("= "), "all pass", "pass" if ok else "FAIL",
                        "" if ok else proc.stdout[-3000:] + proc.stderr[-1500:]))
    return rows


def collect_tests(check: Check, tests: Future) -> None:
    """The test rows, waiting for the runs to end; a failed run's output goes under the table."""
    for row in tests.result(timeout=check.plan.tests_timeout + 60):
        check.rows.append(row)
        if row.output:
            check.details.append(f"--- {row.check}:\n{row.output}")


# ---- 2. bandwidth and kernels -----------------------------------------------------------------
def copy_bandwidth(check: Check) -> None:
    """Bytes moved per second by a device-to-device copy (read plus write)."""
    import torch

    src = torch.empty(check.plan.copy_bytes, dtype=torch.uint8, device=check.plan.device)
    dst = torch.empty_like(src)
    check.bandwidth = 2 * src.numel() / timed(lambda: dst.copy_(src), check.plan.device)
    check.add("copy bandwidth", f"{check.bandwidth / 1e12:.3f} TB/s "
                                f"({src.numel() / GIB:.3g} GiB copied)")


def attention_case(device: str, context: int, decodes: int, prefill_chunks: int, chunk: int) -> dict:
    """One paged-attention call of a Llama-3-8B layer over a shuffled block pool."""
    import torch

    from travelator.kernels import triton_attention
    from travelator.model.attention import build_metadata

    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    query_lens = [1] * decodes + [chunk] * prefill_chunks
    seq_lens = [context + n for n in query_lens]
    need = [-(-s // block_size) for s in seq_lens]
    blocks = list(range(sum(need)))
    random.Random(0).shuffle(blocks)
    tables, at = [], 0
    for n in need:
        tables.append(blocks[at:at + n])
        at += n
    cache_shape = (len(blocks), kv_heads, block_size, head_dim)
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(query_lens), heads, head_dim, dtype=torch.bfloat16, device=device)
    meta = build_metadata("triton", torch.empty(0, dtype=torch.long), query_lens,
                          [context] * len(query_lens), tables, block_size, torch.device(device))
    args = (q, k_cache, v_cache, meta.query_start, meta.seq_lens, meta.block_tables,
            head_dim**-0.5, 0, meta.max_query_len, meta.max_seq_len)
    repeats = 20 if device == "cuda" else 1
    seconds = timed(lambda: triton_attention.paged_attention(*args), device, repeats)
    kv_bytes = sum(seq_lens) * kv_heads * head_dim * 2 * 2  # keys and values, bf16
    return dict(seconds=seconds, kv_bytes=kv_bytes)


def kernels(check: Check) -> None:
    """The paged-attention cases and the sampler's race: figures without targets."""
    import torch

    from travelator.kernels import triton_sampling

    device = check.plan.device
    for context, decodes, chunks, chunk in check.plan.attention:
        got = attention_case(device, context, decodes, chunks, chunk)
        share = got["kv_bytes"] / got["seconds"] / check.bandwidth if check.bandwidth else 0.0
        name = f"attention: {decodes} decodes x {context} context" + (
            f" + {chunks} chunks of {chunk}" if chunks else "")
        check.add(name, f"{got['seconds'] * 1e6:.0f} us, {share:.0%} of copy bandwidth on KV reads")
    rows, vocab = check.plan.race
    scores = torch.randn(rows, vocab, device=device)
    seeds = torch.arange(rows, device=device)
    seconds = timed(lambda: triton_sampling.exponential_race(scores, seeds), device,
                    20 if device == "cuda" else 1)
    check.add(f"exponential race: {rows} rows x {vocab} vocab", f"{seconds * 1e6:.0f} us")


# ---- 3. engines -------------------------------------------------------------------------------
def start_engine(plan: Plan, batching: str = "iteration") -> Any:
    from travelator import LLM

    return LLM(plan.model, device=plan.device, dtype="bfloat16", batching=batching,
               max_num_seqs=plan.max_num_seqs, max_num_batched_tokens=plan.max_num_batched_tokens,
               max_model_len=plan.max_model_len, kv_cache_bytes=plan.kv_cache_bytes)


def load_engine(check: Check) -> None:
    t0 = time.perf_counter()
    check.llm = start_engine(check.plan)
    engine = check.llm.engine
    check.add(f"engine start-up: {check.plan.model}",
              f"{time.perf_counter() - t0:.0f} s ({engine.arch.num_parameters / 1e6:,.0f}M params, "
              f"{str(engine.dtype).replace('torch.', '')}, {engine.device}, "
              f"attention {getattr(engine.runner, 'ops', None) and engine.runner.ops.attention_backend})")


def the_engine(check: Check) -> Any:
    if check.llm is None:
        raise RuntimeError("no engine: its start-up failed or was skipped")
    return check.llm.engine


def decode_step_seconds(engine: Any, prompts: list[list[int]], steps: int) -> float:
    """Median engine step while every request decodes: prompts prefilled, two warm-up steps,
    ``steps`` timed (whole steps: schedule, prepare, forward, sample), then the rest aborted."""
    from travelator import SamplingParams

    ids = [engine.add_request(p, SamplingParams(temperature=0, ignore_eos=True,
                                                max_tokens=engine.max_model_len - len(p))).request_id
           for p in prompts]
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        engine.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    engine.abort_request(ids)
    return statistics.median(times)


# ---- 4. batch-1 decode and 5. the wide decode step -------------------------------------------
def decode_weight_bytes(model: Any) -> int:
    """Bytes of every weight a one-token step reads: the embedding only as a tied LM head."""
    total = model.weight_bytes()
    if model.lm_head_weight is not model.embed:
        total -= model.embed.numel() * model.embed.element_size()
    return total


def batch1(check: Check) -> None:
    engine = the_engine(check)
    if not check.bandwidth:
        raise RuntimeError("no copy bandwidth was measured")
    step = decode_step_seconds(engine, [[1, *range(3, 18)]], check.plan.batch1_steps)
    nbytes = decode_weight_bytes(engine.runner.model)
    stream = nbytes / check.bandwidth
    target_row(check, "batch-1 decode step / weights streamed once", step / stream, "<=", 1.3,
               f"step {step * 1e3:.2f} ms; its {nbytes / 1e6:,.0f} MB of weights at copy bandwidth "
               f"{stream * 1e3:.2f} ms")


def wide_decode(check: Check) -> None:
    engine = the_engine(check)
    n, context, steps = check.plan.wide
    rng = random.Random(2)
    vocab = engine.arch.vocab_size
    long = [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(n)]
    short = [[rng.randrange(3, vocab)] for _ in range(n)]
    deep = decode_step_seconds(engine, long, steps)
    bare = decode_step_seconds(engine, short, steps)
    target_row(check, f"decode step {n} x {context} context / {n} x context ~0", deep / bare,
               "<=", 1.5, f"{deep * 1e3:.2f} ms against {bare * 1e3:.2f} ms")


# ---- 6. workload W against transformers --------------------------------------------------------
def travelator_w(llm: Any, work: list[tuple[list[int], int]]) -> float:
    """Seconds for the whole workload through ``LLM.generate``, every request at once."""
    from travelator import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    t0 = time.perf_counter()
    results = llm.generate([p for p, _ in work], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    if [len(r.outputs[0].token_ids) for r in results] != [n for _, n in work]:
        raise RuntimeError("travelator's outputs are not the lengths asked for")
    return seconds


def hf_model(arch: Any, device: str) -> Any:
    """A random-init ``LlamaForCausalLM`` of the arch's shape, built on the device in bf16."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, rope_theta=arch.rope_theta, rms_norm_eps=arch.rms_norm_eps,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return model.to(torch.bfloat16)  # a no-op, unless this transformers ignored the dtype


def hf_generate(model: Any, batch: list[tuple[list[int], int]], device: str) -> float:
    """Seconds for one padded static batch through ``generate``: prompts left-padded, every
    row decoding the batch's longest output (greedy, no stop)."""
    import torch

    width = max(len(p) for p, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, _) in enumerate(batch):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    longest = max(n for _, n in batch)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                             pad_token_id=0)
    sync(device)
    if out.shape[1] - width != longest:
        raise RuntimeError("transformers' outputs are not the lengths asked for")
    return time.perf_counter() - t0


def extrapolated(times: list[float], steps: list[int]) -> float:
    """Seconds for every batch from the first ``len(times)`` run: their time scaled by the
    decode steps (each batch's longest output) of all the batches against theirs."""
    return sum(times) * sum(steps) / sum(steps[:len(times)])


def transformers_w(plan: Plan, arch: Any, work: list[tuple[list[int], int]],
                   seconds: float) -> tuple[float, int, int]:
    """transformers' seconds for the workload (extrapolated past ``seconds`` of batches: at
    least one runs), the batches run and the batches in all."""
    model = hf_model(arch, plan.device)
    hf_generate(model, [(p[:8], 4) for p, _ in work[:2]], plan.device)  # warm-up
    batches = [work[i:i + plan.hf_batch] for i in range(0, len(work), plan.hf_batch)]
    deadline = time.perf_counter() + seconds
    times: list[float] = []
    for batch in batches:
        times.append(hf_generate(model, batch, plan.device))
        if time.perf_counter() + times[-1] > deadline:
            break
    steps = [max(n for _, n in batch) for batch in batches]
    return extrapolated(times, steps), len(times), len(batches)


def workload_section(check: Check) -> None:
    """W through the engine, then through transformers' generate."""
    import torch

    plan, engine = check.plan, the_engine(check)
    work = workload_w(0, plan.w_requests, plan.w_recipe)
    outputs = sum(n for _, n in work)
    ours = travelator_w(check.llm, work)
    name = f"W x {len(work)}"
    check.add(f"{name}: travelator", f"{ours:.1f} s, {outputs / ours:.0f} output tok/s")
    check.need(plan.hf_seconds + 30)
    try:
        seconds = min(plan.hf_seconds, check.left() - ORCA_NEED_S - 30)
        hf, ran, total = transformers_w(plan, engine.arch, work, seconds)
    finally:
        gc.collect()
        if plan.device == "cuda":
            torch.cuda.empty_cache()
    how = "all batches run" if ran == total else (
        f"{ran} of {total} batches run, the rest extrapolated by decode steps")
    target_row(check, f"{name}: travelator / transformers generate", hf / ours, ">=", 10,
               f"{outputs / ours:.0f} against {outputs / hf:.0f} output tok/s "
               f"(transformers: static batches of {plan.hf_batch}, {how})")


# ---- 7. the Orca comparison -------------------------------------------------------------------
def orca_runs(plan: Plan, engines: dict[str, Any], vocab: int) -> list[dict]:
    """Both engines over the same requests and arrivals at shares of the iteration engine's
    capacity (its requests per second with all of them present at once)."""
    from travelator.bench.arrivals import arrival_times
    from travelator.bench.metrics import compute_metrics
    from travelator.bench.runner import run_engine
    from travelator.bench.workloads import RequestSpec, Workload

    pairs = workload_w(1, plan.orca_requests, plan.w_recipe)
    work = Workload("W", 1, [RequestSpec(p, n) for p, n in pairs], {"vocab_size": vocab})
    n = len(work)
    capacity = n / run_engine(engines["iteration"], work, progress=False).duration_s
    rows = []
    for k, share in enumerate(plan.orca_rate_shares):
        arrivals = arrival_times(n, capacity * share, seed=0)
        order = list(engines.items())
        for name, engine in order if k % 2 == 0 else order[::-1]:  # no mode always first
            run = run_engine(engine, work.salted(k + 1), arrivals, progress=False)
            rows.append({"rate": capacity * share, "scheduler": name,
                         **compute_metrics(run.results, run.duration_s)})
    return rows


def orca(check: Check) -> None:
    from travelator.bench.compare import default_latency_target, ratio_line
    from travelator.bench.runner import warm_up

    iteration = the_engine(check)
    static = start_engine(check.plan, "static").engine
    warm_up(static)
    rows = orca_runs(check.plan, {"static": static, "iteration": iteration},
                     iteration.arch.vocab_size)
    static.shutdown()
    target = default_latency_target(rows)
    line, info = ratio_line(rows, target, "iteration", "static")
    check.details.append(line)
    name = "Orca: iteration-level / static batching"
    at = f"at median normalised latency <= {target * 1e3:.1f} ms/token"
    it, st = info["iteration_req_per_s"], info["static_req_per_s"]
    if info["ratio"] is not None:
        head = line.rsplit("-> ", 1)[1]  # the ratio, with "at least" where it is a bound
        check.add(name, f"{head}: {it:.2f} against {st:.2f} req/s {at}", ">= 3x",
                  judge(info["ratio"], ">=", 3))
    elif it is not None:
        check.add(name, f"unbounded: static misses the target at every rate ({it:.2f} req/s {at})",
                  ">= 3x", "pass")
    else:
        check.add(name, f"n/a: iteration-level misses the target at every rate ({at})", ">= 3x",
                  "FAIL")


# ---- the run ----------------------------------------------------------------------------------
def environment(check: Check) -> None:
    import torch

    on_gpu = check.plan.device == "cuda"
    check.add("device", torch.cuda.get_device_name() if on_gpu else "CPU (smoke run: tiny shapes)")
    versions = [f"torch {torch.__version__}"]
    for name in ("triton", "transformers"):
        try:
            versions.append(f"{name} {__import__(name).__version__}")
        except ImportError:
            versions.append(f"{name} missing")
    check.add("versions", ", ".join(versions))


def run_all(check: Check) -> None:
    with ThreadPoolExecutor(1) as pool:
        tests = pool.submit(run_tests, check.plan)  # beside the engine's start-up
        guarded(check, "environment", 0, environment)
        guarded(check, f"engine start-up: {check.plan.model}", 60, load_engine)
        guarded(check, "tests", 0, lambda c: collect_tests(c, tests))
    guarded(check, "copy bandwidth", 5, copy_bandwidth)
    guarded(check, "attention and sampling kernels", 15, kernels)
    guarded(check, "batch-1 decode step / weights streamed once", 10, batch1)
    guarded(check, "decode step, deep context / context ~0", 30, wide_decode)
    guarded(check, f"W x {check.plan.w_requests}", 60, workload_section)
    guarded(check, "Orca: iteration-level / static batching", ORCA_NEED_S, orca)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="every section on the CPU at tiny shapes (Triton under its interpreter)")
    ap.add_argument("--budget", type=float, help="seconds before the remaining sections are skipped")
    args = ap.parse_args(argv)
    plan = SMOKE_PLAN if args.cpu_smoke else GPU_PLAN
    if args.budget is not None:
        plan = replace(plan, budget=args.budget)
    if args.cpu_smoke:  # read when triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here (--cpu-smoke runs the sections on the CPU)")
    check = Check(plan)
    run_all(check)
    print(format_table(check.rows))
    print("\n".join(check.details))
    print(f"gpu_check: {time.monotonic() - check.start:.0f} s in all")
    return exit_status(check.rows, args.cpu_smoke)


if __name__ == "__main__":
    sys.exit(main())
