"""Tiny random-init checkpoints in Hugging Face layout, built with transformers itself.

``initializer_range=0.5`` gives logits wide margins, so a greedy mismatch means a
bug rather than a float rounding difference.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

VOCAB = 300


def _save_tokenizer(path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(path)


def phi3_overrides(original: int, maximum: int, partial: float = 0.75, head_dim: int = 32) -> dict:
    """A Phi-3 config's LongRoPE (random short and long factors, one per rotary pair) and partial
    rotary (Phi-4-mini's 0.75), pretrained on ``original`` positions and extended to ``maximum``."""
    import random

    rng = random.Random(0)
    pairs = int(head_dim * partial) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.5 * rng.random() for _ in range(pairs)],
            "long_factor": [1.0 + 8 * rng.random() for _ in range(pairs)],
            "original_max_position_embeddings": original}
    return dict(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=maximum, original_max_position_embeddings=original,
                rope_parameters=rope, sliding_window=None, pad_token_id=0)


def gemma3_overrides(window: int = 4096) -> dict:
    """Gemma 3's text model in small: head_dim 32 beside hidden 64, query_pre_attn_scalar of its
    own, sliding and global layers interleaved (each with its rope base; the global ones with
    linear rope scaling), a window of ``window`` keys, the embedding scaled."""
    return dict(
        head_dim=32, query_pre_attn_scalar=24, num_hidden_layers=3, sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}},
        # Untied: a tied LM head reads back the scaled embedding of the last token, and greedy
        # tokens of a random model then repeat it forever.
        tie_word_embeddings=False, pad_token_id=0,
    )


def mixtral_overrides() -> dict:
    """Mixtral in small: 8 experts of intermediate 32, top-2 (always renormalised)."""
    return dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=None)


def qwen3_moe_overrides(norm_topk_prob: bool = True) -> dict:
    """Qwen3-MoE in small: many small experts (16 of intermediate 16), top-4, the q/k head
    norms, and a dense MLP (intermediate 128) in the layer mlp_only_layers names."""
    return dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, intermediate_size=128,
                norm_topk_prob=norm_topk_prob, num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1,
                head_dim=32)


def gpt_oss_overrides(window: int = 5) -> dict:
    """gpt-oss in small: 8 experts of width 32, top-2 (softmax over the top-k logits), sliding
    layers of ``window`` keys alternating with full ones, sinks, YaRN rope (the config's default:
    factor 32 over 4096 positions), biases everywhere (randomize them: transformers starts the
    experts' at zero)."""
    return dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                num_hidden_layers=4, sliding_window=window, swiglu_limit=7.0, pad_token_id=0)


def randomize(path: Path, suffixes: tuple[str, ...], scale: float, offset: float = 0.0, seed: int = 1) -> None:
    """Redraw the checkpoint's tensors whose names end with ``suffixes`` as offset + scale * U(-1, 1)
    (transformers initialises norms and biases to constants, which hide mistakes in them)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name, t in weights.items():
        if name.endswith(suffixes):
            weights[name] = offset + scale * (2 * torch.rand(t.shape, generator=g) - 1)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def build_checkpoint(path: Path, family: str, **overrides) -> Path:
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM,
                              MixtralConfig, MixtralForCausalLM,
                              Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    common.update(overrides)
    cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    }[family]
    torch.manual_seed(0)
    model = cls[1](cls[0](**common)).eval()
    model.save_pretrained(path)
    _save_tokenizer(path)
    return path


def load_reference(path: Path):
    from transformers import AutoModelForCausalLM

    # Mixtures of experts: transformers' plain loop over experts (its grouped kernels take no
    # float64, which the logprob tests run the reference in).
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of one request alone, through transformers' own generate."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position of ``tokens`` (float64 for a float64
    model, else float32)."""
    logits = model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)


def assert_greedy_matches(llm, ref, prompts: list[list[int]], max_tokens: int, abs_logprob: float) -> None:
    """``llm``'s greedy tokens for each prompt alone are transformers' (``ref``), and each chosen
    token's logprob is within ``abs_logprob`` of transformers' on the same tokens."""
    from travelator import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    for prompt, result in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        out = result.outputs[0]
        assert out.token_ids == reference_greedy(ref, prompt, max_tokens)
        want = reference_logprobs(ref, prompt + out.token_ids)
        for i, lp in enumerate(out.logprobs):
            assert abs(lp.logprob - float(want[len(prompt) - 1 + i][lp.token_id])) <= abs_logprob, (i, lp)


def mxfp4_checkpoint(path: Path) -> Path:
    """A gpt-oss checkpoint with random MXFP4 experts in place of float ones, as the released
    checkpoints store them ([experts, out, in / 32, 16] codes, [experts, out, in / 32] scales)."""
    build_checkpoint(path, "gpt_oss", **dict(gpt_oss_overrides(), intermediate_size=64))
    randomize(path, ("bias", "sinks"), 0.5)
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = weights.pop(name).shape
        weights[name + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=g,
                                                  dtype=torch.uint8)
        weights[name + "_scales"] = torch.randint(122, 130, (experts, outputs, inputs // 32), generator=g,
                                                  dtype=torch.uint8)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path
