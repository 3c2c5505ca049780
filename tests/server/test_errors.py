"""Bad input gives a clear error and leaves the engine usable."""

from __future__ import annotations

import math

import pytest

from hf_models import build_checkpoint
from paths import STORIES, needs_stories
from travelator import LLM, SamplingParams
from travelator.errors import InvalidRequestError
from travelator.model.model_file_error import ModelFileError
from travelator.sampling_params import StopLimits

pytestmark = needs_stories


@pytest.fixture(scope="module")
def llm():
    return LLM(str(STORIES), dtype="float32", max_model_len=64)


def still_works(llm: LLM) -> None:
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out[0].text == ", there was a little"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    still_works(llm)


def test_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match=r"70 tokens.*context is 64"):
        llm.generate([[1] + [300] * 69], SamplingParams())
    with pytest.raises(ValueError, match="more than the context"):
        llm.generate("Once upon a time", SamplingParams(max_tokens=64))
    still_works(llm)


def test_one_bad_prompt_fails_the_call_and_leaves_nothing_behind(llm):
    with pytest.raises(ValueError):
        llm.generate(["Once upon a time", ""], SamplingParams(max_tokens=5))
    still_works(llm)


def test_bad_token_ids(llm):
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        llm.generate([[1, 512]], SamplingParams())
    still_works(llm)


@pytest.mark.parametrize("kw", [{"max_tokens": -1}, {"max_tokens": -3}, {"temperature": -1},
                                {"top_p": 0}, {"n": 0}, {"logprobs": 50}, {"prompt_logprobs": 21},
                                {"prompt_logprobs": -1}])
def test_bad_sampling_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


_FLOATS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]


@pytest.mark.parametrize("name", _FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused_by_name(name, value):
    with pytest.raises(InvalidRequestError, match=f"{name} must be a finite number") as exc:
        SamplingParams(**{name: value})
    assert exc.value.param == name


@pytest.mark.parametrize("kw,param", [
    ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
])
def test_stop_bounds_by_default(kw, param):
    with pytest.raises(InvalidRequestError, match="more than the limit") as exc:
        SamplingParams(**kw)
    assert exc.value.param == param
    SamplingParams(stop=[f"s{i}" for i in range(64)], stop_token_ids=list(range(64)))  # at the limits
    SamplingParams(stop="x" * 256)


def test_stop_bounds_can_be_raised():
    limits = StopLimits(max_stop_strings=10_000, max_stop_string_chars=1000, max_stop_token_ids=100)
    params = SamplingParams(stop=[f"s{i}" for i in range(9_999)] + ["x" * 1000], stop_token_ids=list(range(100)),
                            stop_limits=limits)
    assert params.for_choice(1).stop_limits == limits  # each choice keeps them
    with pytest.raises(ValueError, match="max_stop_strings must be at least 1"):
        StopLimits(max_stop_strings=0).validate()


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="unknown dummy preset"):
        LLM("dummy:nope")


def test_corrupt_safetensors(tmp_path):
    path = build_checkpoint(tmp_path / "m", "llama")
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ModelFileError, match="is not a readable safetensors file") as e:
        LLM(str(path))
    assert e.value.path == str(path / "model.safetensors")


def test_truncated_safetensors_tensor(tmp_path):
    path = build_checkpoint(tmp_path / "m", "llama")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="is not a readable safetensors file") as e:
        LLM(str(path))
    assert e.value.path == str(path / "model.safetensors")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(STORIES.read_bytes()[:4096])
    with pytest.raises(ModelFileError, match=r"truncated\?") as e:
        LLM(str(bad))
    assert e.value.path == str(bad)
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFileError, match="magic") as e:
        LLM(str(bad))
    assert e.value.path == str(bad) and e.value.field == "header"


def test_kv_pool_smaller_than_context_is_refused():
    with pytest.raises(ValueError, match="KV pool holds"):
        LLM(str(STORIES), max_model_len=256, block_size=16, num_kv_blocks=4)


def test_stop_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 512\)"):
        llm.generate("Once upon a time", SamplingParams(min_tokens=2, stop_token_ids=[5000]))
    still_works(llm)
