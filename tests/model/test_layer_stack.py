"""The native layer stack (csrc/layer_stack.cpp, model/layer_stack.py) against the Python
layers it stands in for: the same kernels in the same order, so a generation gives the same
tokens and the same logprobs, bit for bit, with the stack on and off. The Python layers are
the reference (checked against transformers and llama.cpp elsewhere); each run also shows
that the stack took the steps it covers and left the others (steps of more rows than a
streaming kernel takes) to Python."""

from __future__ import annotations

import pytest
import torch

from hf_models import build_checkpoint

from travelator import LLM, SamplingParams, kernels
from travelator.model.layer_stack import LayerStack
from travelator.model.linear_route import LinearRoute

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")

PROMPTS = [[1, 5, 9, 200, 33, 7], [1, 44, 3], [1, 8, 8, 8, 70, 71, 72, 73, 9]]


def _generate(llm: LLM, use_stack: bool) -> tuple[list, int]:
    """Tokens and logprobs of every prompt, and how many steps went through the stack."""
    out, rows = _generate_rows(llm, use_stack)
    return out, len(rows)


def _prompt(length: int) -> list[int]:
    return [1] + list(range(3, 2 + length))


def _generate_rows(llm: LLM, use_stack: bool, prompts: list[list[int]] = PROMPTS,
                   max_tokens: int = 10) -> tuple[list, list[int]]:
    """Tokens and logprobs of every prompt, and the rows of each step that went through the stack."""
    runner = llm.engine.runner
    runner.model.use_layer_stack = use_stack
    ops, calls = runner.ops, []
    native = type(ops).decoder_layers

    def counted(*args):
        calls.append(args[0].shape[0])
        return native(ops, *args)

    ops.decoder_layers = counted
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
        results = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del ops.decoder_layers
    out = [(r.token_ids, [(lp.logprob, lp.top_logprobs) for lp in r.outputs[0].logprobs]) for r in results]
    return out, calls


@pytest.mark.parametrize("model,dtype,quantization,kv", [
    ("dummy:tiny", "bfloat16", "none", "auto"),
    ("dummy:tiny", "bfloat16", "int8", "auto"),
    ("dummy:tiny", "bfloat16", "int4", "auto"),
    ("dummy:tiny", "float32", "int4", "auto"),
    ("dummy:tiny", "bfloat16", "int4", "int8"),
    # Mixtures of experts: the router, top-k and weighted sum in C++, the experts in one call.
    ("dummy:qwen3-moe-tiny", "bfloat16", "none", "auto"),
    ("dummy:qwen3-moe-tiny", "bfloat16", "int8", "auto"),
    ("dummy:qwen3-moe-tiny", "bfloat16", "int4", "auto"),
])
def test_the_layer_stack_gives_the_python_layers_bits(model, dtype, quantization, kv):
    # Two seats: decode steps of one and two rows (bf16 streams up to 4 rows: small_m_linear on
    # AVX512-BF16, panel_linear on AVX2), prompts in steps of 3-9 rows, the longer ones only int8/int4 stream.
    llm = LLM(model, device="cpu", dtype=dtype, quantization=quantization, quantization_group_size=32,
              kv_cache_dtype=kv, max_num_seqs=2, enable_prefix_caching=False)
    python, none = _generate(llm, use_stack=False)
    stacked, used = _generate(llm, use_stack=True)
    assert none == 0 and used > 0
    assert stacked == python
    if quantization == "none" and hasattr(torch.ops.travelator, "blocked_linear"):
        # AVX512-BF16: tiny's bf16 layers go through blocked_linear (a mixture's router, of
        # fewer than 64 outputs, through small_m_linear).
        routes = set(LayerStack.of(llm.engine.runner.model).linears.ints[0::3])
        assert routes == {LinearRoute.BLOCKED} if model == "dummy:tiny" else LinearRoute.BLOCKED in routes
    if quantization == "none" and hasattr(torch.ops.travelator, "panel_linear"):
        # AVX2: the bf16 layers stream their panels (a mixture's experts their natural layout).
        routes = set(LayerStack.of(llm.engine.runner.model).linears.ints[0::3])
        assert LinearRoute.PANELS in routes


@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_the_layer_stack_adds_a_layers_bias(tmp_path, quantization):
    """Qwen2's QKV bias: added after the integer kernel, as the Python layer adds it; in
    blocked_linear's or panel_linear's float32 sums where those kernels take bf16 layers
    (elsewhere a biased bf16 layer keeps the model in Python). (The checkpoint's biases are
    zeros, transformers' initialisation: they are made random here.)"""
    path = build_checkpoint(tmp_path / "qwen2", "qwen2")
    if quantization == "none" and not any(hasattr(torch.ops.travelator, op) for op in ("blocked_linear", "panel_linear")):
        pytest.skip("no bf16 kernel streams a biased layer on this CPU")
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization=quantization, max_num_seqs=2, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    for layer in llm.engine.runner.model.layers:
        bias = layer.self_attn.qkv_bias
        bias.copy_(torch.randn(bias.shape, generator=g).to(bias.dtype))
    python, _ = _generate(llm, use_stack=False)
    stacked, used = _generate(llm, use_stack=True)
    assert used > 0 and stacked == python


@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_the_layer_stack_norms_qwen3_heads(tmp_path, quantization):
    """Qwen3's per-head q/k norms run in the stack as in the Python layers (with random norm
    weights: transformers initialises them to ones)."""
    path = build_checkpoint(tmp_path / "qwen3", "qwen3", head_dim=32)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization=quantization, max_num_seqs=2, enable_prefix_caching=False)
    if LayerStack.of(llm.engine.runner.model) is None:
        pytest.skip("no bf16 kernel streams these layers on this CPU")
    g = torch.Generator().manual_seed(0)
    for layer in llm.engine.runner.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.copy_((torch.rand(norm.weight.shape, generator=g) + 0.5).to(norm.weight.dtype))
    python, _ = _generate(llm, use_stack=False)
    stacked, used = _generate(llm, use_stack=True)
    assert used > 0 and stacked == python


@pytest.mark.parametrize("windows", [(4, 4), (None, 3)])
def test_the_layer_stack_passes_each_layers_window(tmp_path, windows):
    """Sliding windows shorter than the generations (3-9 prompt tokens, then 10): Mistral's,
    one per layer, and a full layer beside a sliding one (Gemma 3's interleaving), each
    layer's window passed to its attention as the Python layer passes it."""
    path = build_checkpoint(tmp_path / "mistral", "mistral", sliding_window=4)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization="int8", max_num_seqs=2, enable_prefix_caching=False)
    for layer, window in zip(llm.engine.runner.model.layers, windows):
        layer.self_attn.attn.window = window
    assert LayerStack.of(llm.engine.runner.model).windows == [w or 0 for w in windows]
    python, _ = _generate(llm, use_stack=False)
    stacked, used = _generate(llm, use_stack=True)
    assert used > 0 and stacked == python
    for layer in llm.engine.runner.model.layers:  # the windows change the numbers
        layer.self_attn.attn.window = None
    assert _generate(llm, use_stack=False)[0] != python


def _stack_rows_seen(llm: LLM, prompt_len: int) -> list[int]:
    """The rows of every step that ran in the native stack, generating 3 tokens from one prompt."""
    return _generate_rows(llm, True, [_prompt(prompt_len)], max_tokens=3)[1]


def _stack_gives_python_bits(llm: LLM, prompts: list[list[int]], max_tokens: int) -> bool:
    """Whether the prompts' tokens and logprobs are the same bits with the stack off and on."""
    return _generate_rows(llm, False, prompts, max_tokens)[0] == _generate_rows(llm, True, prompts, max_tokens)[0]


def test_steps_the_stack_does_not_cover_run_the_python_layers():
    """An int8 prompt (more rows than the integer kernel takes, no bf16 copies kept) never
    reaches the stack."""
    llm = LLM("dummy:tiny", device="cpu", dtype="bfloat16", quantization="int8", quantized_gemm_copies="off",
              max_num_seqs=1, enable_prefix_caching=False)
    rows = llm.engine.runner.ops.streaming_rows(True, True)
    assert rows >= 1
    seen = _stack_rows_seen(llm, 4 * rows)
    assert seen and max(seen) <= rows  # decodes only: the prompt's step ran in Python


@pytest.mark.skipif(not hasattr(torch.ops.travelator, "blocked_linear"), reason="built on AVX512-BF16 CPUs")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_steps_past_the_integer_kernels_take_the_kept_copies_in_the_stack(quantization):
    """Quantized layers keeping bf16 copies for blocked_linear: steps past the integer kernel's
    rows (prompts of 20-40 tokens) run in the stack on the copies, the Python layers' bits;
    steps within them (decodes) on the integer kernels."""
    llm = LLM("dummy:tiny", device="cpu", dtype="bfloat16", quantization=quantization, quantization_group_size=32,
              max_num_seqs=3, enable_prefix_caching=False)
    ops = llm.engine.runner.ops
    assert ops.gemm_copies
    assert _stack_gives_python_bits(llm, [_prompt(n) for n in (21, 32, 41)], max_tokens=6)
    seen = _stack_rows_seen(llm, 40)
    assert seen[0] == 40 > ops.streaming_rows(True, quantization == "int8") and seen[1:] == [1, 1]


@pytest.mark.skipif(not hasattr(torch.ops.travelator, "blocked_linear"), reason="built on AVX512-BF16 CPUs")
def test_a_prompt_runs_in_the_stack_where_blocked_linear_takes_every_layer():
    """blocked_linear takes every row count: a bf16 prompt's step runs in the stack too, to the
    Python layers' bits."""
    llm = LLM("dummy:tiny", device="cpu", dtype="bfloat16", max_num_seqs=1, enable_prefix_caching=False)
    assert _stack_gives_python_bits(llm, [_prompt(100)], max_tokens=3)
    assert _stack_rows_seen(llm, 100) == [100, 1, 1]


@pytest.mark.skipif(not hasattr(torch.ops.travelator, "blocked_linear"), reason="built on AVX512-BF16 CPUs")
def test_a_mixtures_prompt_in_the_stack_gives_the_python_layers_bits(tmp_path):
    """A mixture whose every layer, the router of 64 experts included, takes blocked_linear:
    its prompt of 100 rows runs in the stack, the experts through the native experts call,
    to the bits of the Python layers (each expert's rows through its own GEMM)."""
    from hf_models import qwen3_moe_overrides

    path = build_checkpoint(tmp_path / "moe", "qwen3_moe",
                            **dict(qwen3_moe_overrides(), num_experts=64, moe_intermediate_size=64))
    llm = LLM(str(path), device="cpu", dtype="bfloat16", max_num_seqs=1, enable_prefix_caching=False)
    assert set(LayerStack.of(llm.engine.runner.model).linears.ints[0::3]) == {LinearRoute.BLOCKED}
    assert _stack_gives_python_bits(llm, [_prompt(100)], max_tokens=3)
    assert _stack_rows_seen(llm, 100) == [100, 1, 1]
