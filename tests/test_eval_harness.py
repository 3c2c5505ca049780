"""lm-evaluation-harness against the server: its ``local-completions`` model scores a small
task defined here (no dataset download) through /v1/completions (echo, logprobs,
max_tokens 1) with the server's own tokenizer (/tokenizer_info, /tokenize, /detokenize), and
its loglikelihoods equal the offline engine's prompt logprobs of the same token ids."""

from __future__ import annotations

import math

import pytest

from live import serve_in_thread
from paths import STORIES, needs_stories
from travelator import LLM, SamplingParams
from travelator.engine.async_engine import AsyncEngine
from travelator.server.app import build_app
from travelator.server.settings import ServerSettings

lm_eval = pytest.importorskip("lm_eval")
pytestmark = needs_stories

MODEL = "stories"
# (context, continuation): story-like text, and the same context with an unlikely ending.
TASK = [
    ("Once upon a time, there was a little", " girl"),
    ("Once upon a time, there was a little", " volcano"),
    ("Lily saw a big, red ball. She wanted to", " play with it."),
    ("Tom and his mom went to the", " park"),
]


def test_local_completions_loglikelihoods_equal_offline_prompt_logprobs():
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    llm = LLM(str(STORIES), dtype="float32")
    app = build_app(AsyncEngine(llm.engine), ServerSettings(served_model_names=[MODEL]))
    with serve_in_thread(app) as url:
        lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=MODEL, tokenizer_backend="auto",
                                 num_concurrent=1, max_retries=1)
        assert lm.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize
        requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                    for i, pair in enumerate(TASK)]
        results = lm.loglikelihood(requests, disable_tqdm=True)
        encoded = [lm._encode_pair(ctx, cont) for ctx, cont in TASK]  # how it tokenised them

    offline = LLM(str(STORIES), dtype="float32")
    for (ctx_ids, cont_ids), (got_logprob, got_greedy) in zip(encoded, results):
        ids = ctx_ids + cont_ids
        ref = offline.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
        entries = ref.prompt_logprobs[len(ctx_ids):]
        assert got_logprob == pytest.approx(sum(e.logprob for e in entries), abs=1e-4)
        greedy = all(next(iter(e.top_logprobs)) == e.token_id for e in entries)
        assert got_greedy == greedy
    # The model prefers the story's word: a sanity check that the scores mean something.
    assert results[0][0] > results[1][0]
    assert math.isfinite(results[2][0]) and results[0][1]
