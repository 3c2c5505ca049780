"""Output processing: a step's tokens become ``RequestOutput``s (text, stop strings,
logprobs).

It is the one place that decides whether a request stops: EOS, a stop token, its length or a
stop string, checked token by token in order, after detokenizing (under speculative decoding a
stop string may end a request at any of the several tokens one step gave it). The engine then
tells the scheduler once (``SchedulerBase.stop_request``), which drops the tokens after the
one that ended the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from travelator.engine.detokenizer import IncrementalDetokenizer
from travelator.engine.outputs import RequestOutput, TokenLogprob
from travelator.engine.request import Request, RequestStatus, Stop, stop_by_token
from travelator.engine.scheduler_output import SampledToken
from travelator.engine.step_stats import EngineCounters

if TYPE_CHECKING:
    from travelator.model.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, counters: EngineCounters) -> None:
        self._tokenizer = tokenizer
        self._counters = counters
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_request(self, req: Request) -> None:
        params = req.sampling_params
        detok = IncrementalDetokenizer(
            self._tokenizer, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens, prompt_token_ids=req.prompt_token_ids,
        )
        if req.output_token_ids:
            # A handed-off request: its first tokens' text is replayed, so that a stop string
            # that begins there is still found; what the engine that sampled them released
            # (the same text: the same tokenizer and stop strings) is not released again.
            detok.add_tokens(req.output_token_ids)
            detok.take_delta()
        self.detokenizers[req.request_id] = detok

    def find_stop(self, req: Request, toks: list[SampledToken]) -> tuple[int, Stop | None]:
        """Detokenize the tokens ``req`` got this step (the last of its outputs) up to the
        first that ends it. Returns how many of them it keeps, and why it stops (None: it
        goes on)."""
        detok = self.detokenizers[req.request_id]
        params = req.sampling_params
        first = len(req.output_token_ids) - len(toks)
        for i, tok in enumerate(toks):
            stop = stop_by_token(req, tok.token_id, first + i + 1)
            # A token that ends the request (EOS, a stop token) is no text, except a stop token
            # that include_stop_str_in_output keeps.
            is_text = (stop is None or stop.status != RequestStatus.FINISHED_STOPPED
                       or (params.include_stop_str_in_output and stop.reason is not None))
            if is_text and (stop_str := detok.add_tokens([tok.token_id])) is not None:
                return i + 1, Stop(RequestStatus.FINISHED_STOPPED, stop_str)
            if stop is not None:
                return i + 1, stop
        if len(req.output_token_ids) >= req.max_tokens:  # max_tokens=0: the prompt was all
            return len(toks), Stop(RequestStatus.FINISHED_LENGTH)
        return len(toks), None

    def step_output(self, req: Request, toks: list[SampledToken]) -> RequestOutput:
        """The output of a step that gave ``req`` these tokens (after ``find_stop``'s cut)."""
        self._counters.generation_tokens += len(toks)
        new_ids = [tok.token_id for tok in toks]
        logprobs = [TokenLogprob(tok.token_id, tok.logprob, tok.top_logprobs or {})
                    for tok in toks if tok.logprob is not None]
        if req.status.finished:
            return self.finish_output(req, new_ids, logprobs)
        detok = self.detokenizers[req.request_id]
        return self._output(req, new_ids, detok.take_delta(), logprobs, detok.output_text)

    def finish_output(self, req: Request, new_ids: list[int] | None = None,
                      logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """The last output of a finished request; its detokenizer goes."""
        detok = self.detokenizers.pop(req.request_id)
        if req.hand_off and req.status == RequestStatus.FINISHED_LENGTH:
            # Its text goes on in another engine: a tail that may begin a stop string is held
            # back for that engine to release (or cut).
            delta = detok.take_delta()
        else:
            delta = detok.take_delta() + detok.flush()
        reason = req.status.finish_reason
        self._counters.finished[reason] = self._counters.finished.get(reason, 0) + 1
        return self._output(req, new_ids or [], delta, logprobs or [], detok.output_text)

    def _output(self, req: Request, new_ids: list[int], delta: str, logprobs: list[TokenLogprob],
                text: str) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            text=text,
            new_token_ids=new_ids,
            new_text=delta,
            new_logprobs=logprobs,
            finished=req.status.finished,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_prompt_tokens,
            num_preemptions=req.num_preemptions,
            times=req.times,
            prompt_logprobs=_prompt_logprobs(req),
            pooled=req.pooled if req.status.finished else None,
        )


def _prompt_logprobs(req: Request) -> list[TokenLogprob | None] | None:
    """One entry per prompt token (None for the first, which nothing predicts), once the
    whole prompt has been computed; None when not asked for or not complete yet."""
    if req.sampling_params.prompt_logprobs is None or len(req.prompt_logprobs) < req.num_prompt_tokens - 1:
        return None
    return [None] + [TokenLogprob(t, lp, top, rank) for t, (lp, top, rank) in
                     zip(req.prompt_token_ids[1:], req.prompt_logprobs)]
