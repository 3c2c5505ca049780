"""Peer baseline: the same workload through transformers' ``generate`` in padded static
batches, on a model of the same shape with random weights (speed does not depend on
the weights). Optional: only when transformers is installed.

Requests are taken in workload order, ``batch_size`` at a time, left-padded to the
longest prompt of the batch, and generated for the longest output of the batch
(``min_new_tokens == max_new_tokens``, so EOS never ends a row early). A request's
tokens are the first ``output_len`` of its row; the rest of the row is padding work.
All requests arrive at time 0 and a batch's results come back when its ``generate``
returns, as a caller of the library would see them.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from travelator.bench.metrics import RequestResult
from travelator.bench.runner import RunResult
from travelator.bench.workloads import Workload


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _config(arch):
    from transformers import LlamaConfig

    # Mistral and Qwen2 shapes run as Llama of the same size (Qwen2's QKV biases
    # become biases on all four projections: the same order of work).
    return LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_word_embeddings,
        attention_bias=arch.attention_bias,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


class _TimingStreamer:
    """Records when each generation step of a batch produced its tokens."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:  # generate() first pushes the prompt
            self._seen_prompt = True
            return
        self.times.append(self.clock())

    def end(self) -> None:
        pass


def run_transformers(arch, workload: Workload, *, batch_size: int, dtype: str = "float32",
                     seed: int = 0, progress: bool = True) -> tuple[RunResult, dict]:
    """Returns the run and a dict of padding statistics."""
    import torch
    from transformers import LlamaForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(arch)).to(torch_dtype).eval()
    gen_cfg = model.generation_config
    gen_cfg.pad_token_id = 0

    def generate(prompts: list[list[int]], new_tokens: int, streamer=None):
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  streamer=streamer)

    generate([[5, 6, 7, 8]], 2)  # warm-up
    reqs = workload.requests
    results = [RequestResult(r.prompt_len, r.output_len, 0.0) for r in reqs]
    computed = useful = 0
    bar = tqdm(total=len(reqs), desc="transformers", unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    for start in range(0, len(reqs), batch_size):
        batch = reqs[start:start + batch_size]
        longest_out = max(r.output_len for r in batch)
        longest_prompt = max(r.prompt_len for r in batch)
        streamer = _TimingStreamer(clock)
        generate([r.prompt_token_ids for r in batch], longest_out, streamer)
        end = clock()
        for i, r in enumerate(batch):
            res = results[start + i]
            res.token_times = streamer.times[:r.output_len]
            res.output_len = r.output_len
            res.end = end
            res.success = len(res.token_times) == r.output_len
        computed += len(batch) * (longest_prompt + longest_out)
        useful += sum(r.prompt_len + r.output_len for r in batch)
        bar.update(len(batch))
    duration = clock()
    bar.close()
    padding = {
        "batch_size": batch_size,
        "computed_tokens": int(computed),
        "useful_tokens": int(useful),
        "padding_share": float(1 - useful / computed) if computed else 0.0,
        "dtype": dtype,
    }
    return RunResult(results, duration), padding

