"""Speculative decoding (n-gram prompt lookup): the proposer and the draft-length policy against
hand-computed cases; whole engines against the same engine without speculation (greedy and
seeded outputs token for token, logprobs, with chunked prefill, preemption, stop strings and
max_tokens); the unseeded output distribution against a chi-square test; the counters."""

from __future__ import annotations

import collections

import pytest
from scipy.stats import chi2

from paths import STORIES, needs_stories
from travelator import LLM, SamplingParams
from travelator.engine.request import Request
from travelator.engine.self_check import engine_self_check
from travelator.engine.speculation import Speculator, ngram_proposal


def test_ngram_proposal_by_hand():
    #            0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1]
    assert ngram_proposal(tokens, 1, 3, 4) == []  # 1 never came before
    tokens = [5, 6, 7, 8, 9, 5, 6, 7]
    # Longest suffix first: [5, 6, 7] came at 0, followed by 8, 9, 5, 6.
    assert ngram_proposal(tokens, 1, 3, 4) == [8, 9, 5, 6]
    assert ngram_proposal(tokens, 1, 3, 2) == [8, 9]
    # The latest earlier occurrence wins: [1, 2] at 0 (then 3) and at 3 (then 4).
    assert ngram_proposal([1, 2, 3, 1, 2, 4, 1, 2], 2, 2, 3) == [4, 1, 2]
    # Only suffixes of n_min..n_max tokens: [9] alone matches, [3, 9] does not.
    assert ngram_proposal([9, 4, 3, 9], 2, 3, 2) == []
    assert ngram_proposal([9, 4, 3, 9], 1, 3, 2) == [4, 3]
    assert ngram_proposal([7], 1, 3, 2) == [] and ngram_proposal([1, 1], 1, 1, 0) == []
    # Token ids past the BMP and in the surrogate range are characters like any other.
    assert ngram_proposal([0xD800, 70000, 3, 0xD800, 70000], 2, 2, 1) == [3]


def _request(proposed: int, accepted: int) -> Request:
    req = Request("r", [1, 2], SamplingParams(), max_tokens=10)
    req.speculation.record(proposed, accepted)
    return req


def test_adaptive_length_by_hand():
    spec = Speculator(num_tokens=4, ngram_min=1, ngram_max=3, adaptive=True, saturation_rows=32)
    # No evidence: acceptance 1/2. Alone (threshold 1/32): 0.5**4 = 0.0625 > 0.031 -> 4 drafts.
    assert spec.length(_request(0, 0), 1) == 4
    # 8 running (threshold 0.25): 0.5 > 0.25, 0.25 is not -> 1 draft.
    assert spec.length(_request(0, 0), 8) == 1
    # Acceptance (18 + 1) / (20 + 2) = 0.864 with 8 running: 0.864**9 = 0.27 > 0.25 -> capped at 4.
    assert spec.length(_request(20, 18), 8) == 4
    # Acceptance 1/12 = 0.083 alone: 0.083 > 0.031, 0.0069 is not -> 1 draft.
    assert spec.length(_request(10, 0), 1) == 1
    # From saturation_rows running requests on, nobody speculates.
    assert spec.length(_request(20, 20), 32) == 0
    fixed = Speculator(num_tokens=3, ngram_min=1, ngram_max=3, adaptive=False, saturation_rows=32)
    assert fixed.length(_request(10, 0), 100) == 3
    # With step times measured: 10 ms fixed + 1 ms a request + 0.25 ms a row. At 4 requests
    # a draft needs acceptance above 4 * 0.25 / (10 + 4 * 1.25) = 1/15: acceptance 1/2 gives
    # 3 drafts (0.125 > 0.0667 > 0.0625).
    for requests, rows in [(1, 1), (4, 4), (4, 12), (8, 8), (8, 20), (2, 9)] * 2:
        spec.cost.observe(requests, rows, 0.010 + 0.001 * requests + 0.00025 * rows)
    assert spec.cost.fit() == pytest.approx((0.010, 0.001, 0.00025))
    assert spec.cost.draft_share(4) == pytest.approx(1 / 15)
    assert spec.length(_request(0, 0), 4) == 3
    # A step bound by its rows (0.1 ms fixed, 1 ms a row): at 4 requests the share is 0.98.
    busy = Speculator(num_tokens=4, ngram_min=1, ngram_max=3, adaptive=True, saturation_rows=32)
    for requests, rows in [(1, 1), (4, 4), (4, 12), (8, 8), (8, 20), (2, 9)] * 2:
        busy.cost.observe(requests, rows, 0.0001 + 0.001 * rows)
    assert busy.length(_request(0, 0), 4) == 0
    # Steps whose rows always equal their requests cannot tell a draft's cost: the fallback.
    flat = Speculator(num_tokens=4, ngram_min=1, ngram_max=3, adaptive=True, saturation_rows=32)
    for n in (4, 8, 16) * 4:
        flat.cost.observe(n, n, 0.01 + 0.001 * n)
    assert flat.cost.fit() is None and flat.length(_request(0, 0), 8) == 1

REPEATS = [
    "Once upon a time, there was a little girl named Lily. She loved to play. Once upon a time, there was",
    "Tom and his dog went to the park. Tom and his dog went to the",
    "The sun was hot. The sun was hot. The sun was",
    "Lily saw a bird",
]


def _run(llm: LLM, params) -> list:
    return llm.generate(REPEATS, params, use_tqdm=False)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@needs_stories
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("setup", [dict(), dict(max_num_batched_tokens=24), dict(num_kv_blocks=14)])
def test_stories_outputs_equal_decoding_without_drafts(policy, setup):
    # batch_invariant + float32: a row's numbers do not depend on how many query tokens its
    # request has in the step, so greedy picks cannot flip on a near tie.
    base = dict(device="cpu", dtype="float32", batch_invariant=True, **setup)
    off = LLM(str(STORIES), **base)
    on = LLM(str(STORIES), speculative_method="ngram", speculative_policy=policy, num_speculative_tokens=5, **base)
    greedy = SamplingParams(temperature=0.0, max_tokens=70, logprobs=2)
    ref, got = _run(off, greedy), _run(on, greedy)
    assert _tokens(got) == _tokens(ref)
    for r, g in zip(ref, got):
        assert [lp.logprob for lp in g.outputs[0].logprobs] == [lp.logprob for lp in r.outputs[0].logprobs]
        assert g.outputs[0].text == r.outputs[0].text and g.outputs[0].finish_reason == r.outputs[0].finish_reason
    c = on.engine.counters
    assert c.draft_tokens > 0 and 0 < c.accepted_draft_tokens < c.draft_tokens
    assert c.steps < off.engine.counters.steps  # several tokens in some steps
    if "num_kv_blocks" in setup:
        assert c.preemptions > 0
    # Seeded sampling: the same draws, so the same tokens; stop strings and max_tokens cut
    # a step's tokens where they end the request.
    # Penalties see the drafts before each row as outputs, as decoding token by token would.
    sampled = [SamplingParams(temperature=0.9, seed=i, max_tokens=20 + 9 * i, stop=["sun was h"] if i == 2 else [],
                              frequency_penalty=0.4 if i == 1 else 0.0, repetition_penalty=1.3 if i == 3 else 1.0)
               for i in range(len(REPEATS))]
    hits = on.engine.kv.stats.hit_tokens
    ref, got = _run(off, sampled), _run(on, sampled)
    assert _tokens(got) == _tokens(ref)
    assert on.engine.kv.stats.hit_tokens > hits  # the prompts were seen in the greedy run
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in ref]
    # Opted out: no drafts at all.
    before = on.engine.counters.draft_tokens
    _run(on, SamplingParams(temperature=0.0, max_tokens=30, speculate=False))
    assert on.engine.counters.draft_tokens == before
    report = engine_self_check(on.engine)
    assert not on.engine.has_unfinished_requests() and report["ok"] and report["kv"]["used_blocks"] == 0, report["problems"]


@needs_stories
def test_unseeded_distribution_equals_decoding_without_drafts():
    """Tokens 2-4 of 10,000 unseeded requests per engine (stories260K, temperature 1, a prompt
    that repeats, so drafts are proposed and both accepted and refused): a chi-square test of
    homogeneity at the 0.001 level per position, on tokens seen at least 20 times (the rest
    pooled)."""
    prompt = "Tom and his dog went to the park. Tom and his dog went to the park. Tom and"
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    counts = {}
    for name, kw in [("off", {}), ("on", dict(speculative_method="ngram", speculative_policy="fixed",
                                                num_speculative_tokens=3))]:
        llm = LLM(str(STORIES), dtype="float32", max_num_seqs=256, max_num_batched_tokens=8192, **kw)
        outs = llm.generate([prompt] * 10000, params, use_tqdm=False)
        counts[name] = [collections.Counter(o.outputs[0].token_ids[j] for o in outs) for j in (1, 2, 3)]
        if name == "on":
            c = llm.engine.counters
            assert c.draft_tokens > 1000 and 0.1 < c.accepted_draft_tokens / c.draft_tokens < 0.9, c
    for off, on in zip(counts["off"], counts["on"]):
        common = [t for t in set(off) | set(on) if off[t] + on[t] >= 20]
        rows = [(off[t], on[t]) for t in common]
        rows.append((sum(off.values()) - sum(a for a, _ in rows), sum(on.values()) - sum(b for _, b in rows)))
        n_off, n_on = sum(a for a, _ in rows), sum(b for _, b in rows)
        stat = 0.0
        for a, b in rows:
            if a + b:
                ea, eb = (a + b) * n_off / (n_off + n_on), (a + b) * n_on / (n_off + n_on)
                stat += (a - ea) ** 2 / ea + (b - eb) ** 2 / eb
        assert len(rows) > 10 and stat < chi2.ppf(0.999, len(rows) - 1), (stat, len(rows))


@needs_stories
def test_constrained_requests_speculate_through_their_grammar():
    import json

    import jsonschema

    from travelator.structured import StructuredOutput

    schema = {"type": "array", "items": {"enum": ["cat", "dog", "the cat"]}, "minItems": 6, "maxItems": 12}
    regex = r"(Lily and Tom\. ){3,6}"
    cases = [(StructuredOutput(json=schema), lambda t: jsonschema.validate(json.loads(t), schema) or True),
             (StructuredOutput(regex=regex), lambda t: __import__("re").fullmatch(regex, t) is not None)]
    prompts = ["Lily and Tom. Lily and Tom. Lily and Tom.", '["cat", "dog", "cat", "dog", "cat", "dog"]']
    params = [SamplingParams(temperature=t, seed=3, max_tokens=120, structured=c)
              for c, _ in cases for t in (0.0, 0.9)]
    base = dict(device="cpu", dtype="float32", batch_invariant=True)
    off = LLM(str(STORIES), **base).generate(prompts * 2, params, use_tqdm=False)
    spec = LLM(str(STORIES), speculative_method="ngram", speculative_policy="fixed", **base)
    on = spec.generate(prompts * 2, params, use_tqdm=False)
    assert _tokens(on) == _tokens(off)
    for out, (_, check) in zip(on, [cases[0], cases[0], cases[1], cases[1]]):
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text
    c = spec.engine.counters
    assert c.draft_tokens > 0 and c.accepted_draft_tokens > 0, c


def test_bench_step_summary_reports_acceptance():
    from travelator.bench.runner import RunResult, StepRecord
    from travelator.engine.engine import StepStats

    def step(drafts: int, accepted: int, speculating: int) -> StepRecord:
        return StepRecord(0.0, StepStats(2, 2 + drafts, 0, 2, 0, 2, 0, 0.1, 0.01, drafts, accepted, speculating))

    summary = RunResult([], 1.0, [step(8, 3, 2), step(4, 4, 1), step(0, 0, 0)]).step_summary()
    # 7 of 12 drafts accepted over 3 drafting request-steps.
    assert summary["draft_tokens"] == 12 and summary["accepted_draft_tokens"] == 7
    assert summary["acceptance_rate"] == pytest.approx(7 / 12)
    assert summary["mean_accepted_length"] == pytest.approx(7 / 3)
    assert "draft_tokens" not in RunResult([], 1.0, [step(0, 0, 0)]).step_summary()


@pytest.mark.parametrize("setup", [dict(), dict(max_num_batched_tokens=24), dict(num_kv_blocks=9)])
def test_draft_model_outputs_equal_decoding_without_drafts(tmp_path_factory, setup):
    from hf_models import build_checkpoint

    import shutil

    import safetensors.torch
    import torch

    target = build_checkpoint(tmp_path_factory.mktemp("target"), "llama", max_position_embeddings=256)
    # The draft: the target with noise on every weight, so it agrees with the target often
    # but not always, and drafts are both accepted and refused.
    draft = tmp_path_factory.mktemp("draft") / "m"
    shutil.copytree(target, draft)
    weights = safetensors.torch.load_file(draft / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    noisy = {k: w + 0.1 * w.std() * torch.randn(w.shape, generator=gen) for k, w in weights.items()}
    safetensors.torch.save_file(noisy, draft / "model.safetensors", metadata={"format": "pt"})
    base = dict(device="cpu", dtype="float32", batch_invariant=True, **setup)
    prompts = [[1, 5, 9, 13, 17], [1, 40, 41], [1] + list(range(100, 160)), [1, 7]]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=2, max_tokens=35, ignore_eos=True)]
    ref = LLM(str(target), **base).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target), speculative_method="draft", draft_model=str(draft), num_speculative_tokens=3, **base)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(ref)
    assert [lp.logprob for lp in got[0].outputs[0].logprobs] == [lp.logprob for lp in ref[0].outputs[0].logprobs]
    c = llm.engine.counters
    assert c.draft_tokens > 0 and 0 < c.accepted_draft_tokens < c.draft_tokens, c
    if "num_kv_blocks" in setup:
        assert c.preemptions > 0
    report = engine_self_check(llm.engine)
    assert report["ok"] and report["kv"]["used_blocks"] == 0, report["problems"]
    llm.engine.step()  # the runner hears of the last finished requests at the next step
    assert llm.engine.runner.draft._computed == {}  # ...and forgets them
    # The target as its own draft: every draft of a greedy request is accepted.
    same = LLM(str(target), speculative_method="draft", draft_model=str(target), speculative_policy="fixed", **base)
    greedy = [0, 2]
    assert _tokens(same.generate([prompts[i] for i in greedy], [params[i] for i in greedy], use_tqdm=False)) == [
        _tokens(ref)[i] for i in greedy]
    assert same.engine.counters.accepted_draft_tokens == same.engine.counters.draft_tokens > 0
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(target), speculative_method="draft", draft_model="dummy:tiny")
    with pytest.raises(ValueError, match="draft_model"):
        LLM(str(target), speculative_method="draft")


@needs_stories
def test_an_accepted_draft_eos_ends_a_constrained_request():
    """The prompt holds the request's own answer followed by EOS and more tokens, so the
    lookup drafts the answer, EOS, and what followed it: the request ends at EOS, whole."""
    from travelator.structured import StructuredOutput

    base = dict(device="cpu", dtype="float32", batch_invariant=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredOutput(choice=("big red dog",)))
    off = LLM(str(STORIES), **base)
    answer = off.generate([[1, 300, 301]], params, use_tqdm=False)[0].outputs[0].token_ids
    eos = next(iter(off.engine.eos_token_ids))
    body = [t for t in answer if t != eos]
    prompt = [1, 300, 301] + body + [eos, 7, 8, 9, 10] + [300, 301]
    ref = off.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    on = LLM(str(STORIES), speculative_method="ngram", speculative_policy="fixed", **base)
    got = on.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == "stop" and got.text == "big red dog", got
    assert got.token_ids == ref.token_ids
    assert on.engine.counters.accepted_draft_tokens >= 4  # the answer came as drafts


@needs_stories
def test_server_streams_several_tokens_a_step():
    import openai

    from live import serve_in_thread
    from travelator.engine.async_engine import AsyncEngine
    from travelator.server.app import build_app
    from travelator.server.settings import ServerSettings

    llm = LLM(str(STORIES), dtype="float32", speculative_method="ngram", speculative_policy="fixed")
    app = build_app(AsyncEngine(llm.engine), ServerSettings(served_model_names=["stories"]))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        kw = dict(model="stories", prompt=REPEATS[2], max_tokens=40, temperature=0.0, logprobs=1)
        whole = client.completions.create(**kw)
        text, tokens, chunks = "", 0, 0
        for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].text
                tokens += len(chunk.choices[0].logprobs.tokens) if chunk.choices[0].logprobs else 0
                chunks += 1
            if chunk.usage is not None:
                assert chunk.usage.completion_tokens == whole.usage.completion_tokens == 40
        assert text == whole.choices[0].text and tokens == 40
        assert chunks < 40  # several tokens arrived in one step's chunk
    assert llm.engine.counters.accepted_draft_tokens > 0
