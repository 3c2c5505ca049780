"""travelator against transformers on the same random-init weights and workload.

Workload W: 64 requests, prompt lengths uniform in [16, 256], output lengths uniform
in [8, 256], all present at the start, outputs forced to their lengths, seed 0.
Figure: useful output tokens per second. transformers runs its best configuration
here, padded static batches of 32 through ``generate``; travelator runs
iteration-level scheduling (and, for reference, its own static scheduler).

    python benchmarks/vs_transformers.py --preset llama-50m
    python benchmarks/vs_transformers.py --preset llama-250m --skip-static
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

SHAPES = {
    "llama-50m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=1408),
    "llama-250m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=2816),
}


def workload(seed: int, n: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, 32000) for _ in range(rng.randint(16, 256) - 1)],
             rng.randint(8, 256)) for _ in range(n)]


def build_model(preset: str, path: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, max_position_embeddings=4096, bos_token_id=1,
                      eos_token_id=2, **SHAPES[preset])
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    return model


@torch.inference_mode()
def run_transformers(model, reqs, batch_size: int) -> float:
    """Padded static batches through generate; returns seconds."""
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        longest = max(m for _, m in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                       min_new_tokens=longest, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def run_travelator(path: str, reqs, batching: str, max_num_seqs: int) -> float:
    from travelator import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", batching=batching, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=1024)
    prompts = [p for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert [len(r.token_ids) for r in results] == [m for _, m in reqs]
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(SHAPES), default="llama-50m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--skip-static", action="store_true", help="skip travelator's static scheduler")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()

    reqs = workload(args.seed)
    useful = sum(m for _, m in reqs)
    print(f"workload W: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{useful} output tokens; {torch.get_num_threads()} threads; preset {args.preset} bf16")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        model = build_model(args.preset, d)
        if not args.skip_transformers:
            s = run_transformers(model, reqs, args.hf_batch_size)
            rows.append((f"transformers generate, padded batches of {args.hf_batch_size}", s))
        del model
        if not args.skip_static:
            rows.append((f"travelator static, batches of {args.max_num_seqs}",
                         run_travelator(d, reqs, "static", args.max_num_seqs)))
        rows.append((f"travelator iteration-level, max_num_seqs {args.max_num_seqs}",
                     run_travelator(d, reqs, "iteration", args.max_num_seqs)))
    base = useful / rows[0][1]
    print("\n| configuration | seconds | output tok/s | vs first row |\n|---|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s:.1f} | {useful / s:.1f} | {useful / s / base:.2f}x |")


if __name__ == "__main__":
    main()
