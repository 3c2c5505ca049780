"""OutputProcessor: the one place that decides whether a request stops among the tokens a
step gave it (EOS, stop token, length, stop string), in token order, after detokenizing."""

from __future__ import annotations

import pytest

from travelator.engine.output_processor import OutputProcessor
from travelator.engine.request import Request, RequestStatus, Stop
from travelator.engine.scheduler_output import SampledToken
from travelator.engine.step_stats import EngineCounters
from travelator.model.tokenizer import Tokenizer
from travelator.sampling_params import SamplingParams

EOS = 2
TOKENIZER = Tokenizer.byte_level(300)


def _ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def _step(tokens: list[int], max_tokens: int = 50, **params) -> tuple[OutputProcessor, Request, int, Stop | None]:
    """A request that got ``tokens`` in one step (appended, as the scheduler does), and where
    the processor says it stops."""
    req = Request("r", [1], SamplingParams(max_tokens=max_tokens, **params), max_tokens,
                  eos_token_ids=frozenset({EOS}))
    processor = OutputProcessor(TOKENIZER, EngineCounters())
    processor.add_request(req)
    req.output_token_ids.extend(tokens)
    kept, stop = processor.find_stop(req, [SampledToken(t) for t in tokens])
    return processor, req, kept, stop


def test_tokens_that_end_nothing_are_all_kept():
    processor, req, kept, stop = _step(_ids("hello"))
    assert (kept, stop) == (5, None)
    out = processor.step_output(req, [SampledToken(t) for t in _ids("hello")])
    assert not out.finished and out.new_token_ids == _ids("hello")


@pytest.mark.parametrize("text,stop_at", [("ab<END>cd", 7), ("<END>", 5)])
def test_a_stop_string_ends_the_request_at_the_token_that_completes_it(text, stop_at):
    _, _, kept, stop = _step(_ids(text), stop=["<END>"])
    assert kept == stop_at and stop == Stop(RequestStatus.FINISHED_STOPPED, "<END>")


def test_eos_ends_the_request_and_is_no_text():
    processor, req, kept, stop = _step(_ids("ok") + [EOS] + _ids("more"))
    assert kept == 3 and stop == Stop(RequestStatus.FINISHED_STOPPED)
    assert processor.detokenizers["r"].num_output_tokens == 2


def test_eos_before_min_tokens_or_ignored_does_not_end_it():
    assert _step([EOS] + _ids("abc"), min_tokens=2)[2:] == (4, None)
    assert _step([EOS] + _ids("abc"), ignore_eos=True)[2:] == (4, None)


def test_a_stop_token_ends_it_with_its_id_as_reason():
    stop_id = _ids("x")[0]
    _, _, kept, stop = _step(_ids("abxcd"), stop_token_ids=[stop_id])
    assert kept == 3 and stop == Stop(RequestStatus.FINISHED_STOPPED, stop_id)


def test_the_length_ends_it_at_max_tokens():
    assert _step(_ids("abcd"), max_tokens=3)[2:] == (3, Stop(RequestStatus.FINISHED_LENGTH))


def test_a_prompt_only_request_ends_with_no_tokens():
    assert _step([], max_tokens=0)[2:] == (0, Stop(RequestStatus.FINISHED_LENGTH))
