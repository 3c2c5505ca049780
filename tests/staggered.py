"""Drive an engine with requests that arrive at given steps (greedy, forced lengths)."""

from __future__ import annotations

from travelator import LLM, SamplingParams


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_staggered(llm: LLM, reqs: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
    """Add each (arrival step, prompt, max_tokens) at its step; return outputs by index.

    Checks on the way that no step failed, that every request ran to its length and
    that every KV block is back in the pool at the end.
    """
    engine = llm.engine
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    ids: dict[str, int] = {}
    results: dict[int, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, m) = pending.pop(0)
            ids[engine.add_request(prompt, greedy(m)).request_id] = i
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                assert out.finish_reason == "length"
                results[ids[out.request_id]] = out.output_token_ids
        step += 1
        assert step < 10_000
    engine.kv.check_consistency()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return results
