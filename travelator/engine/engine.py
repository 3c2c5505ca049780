"""LLMEngine: add requests, step, abort. One step = schedule, run the model on the
flat batch, sample, update requests, detokenise, and report what changed."""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass, field

import torch

from travelator.config import EngineConfig
from travelator.engine.block_manager import KVCacheManager, blocks_for
from travelator.engine.detokenizer import IncrementalDetokenizer
from travelator.engine.executor import Executor
from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.engine.kv_handoff import KV_LAYOUT, KVHandoff, KVPoolFullError
from travelator.engine.outputs import RequestOutput, TokenLogprob
from travelator.engine.request import Request, RequestStatus
from travelator.engine.request_factory import RequestFactory
from travelator.engine.scheduler import SchedulerBase
from travelator.engine.scheduler_factory import make_scheduler
from travelator.engine.scheduler_output import RunnerOutput, SampledToken, SchedulerOutput
from travelator.engine.tp_executor import TensorParallelError, make_executor
from travelator.model.device import pick_device, resolve_dtype, resolve_kv_dtype
from travelator.model.loader import ModelSource, open_model
from travelator.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepStats:
    """What one step did, for metrics and occupancy plots."""

    num_requests: int
    num_tokens: int
    num_prefill_tokens: int
    num_decodes: int
    num_preempted: int
    num_running: int
    num_waiting: int
    kv_usage: float
    duration_s: float
    # Speculative decoding: drafts verified, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_speculating: int = 0  # requests that verified drafts


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (counted once)
    computed_prompt_tokens: int = 0  # prompt tokens actually computed (recompute included)
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: draft tokens verified, how many were accepted, and the
    # request-steps that verified drafts (accepted / those: mean accepted length).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    speculative_steps: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        mc = config.model
        source = open_model(mc.model, mc.load_format)
        self.model_name = source.name
        self.arch = source.arch
        self.tokenizer = source.tokenizer
        self.device = pick_device(mc.device)
        dtype = resolve_dtype(mc.dtype, source.checkpoint_dtype, self.device)
        kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype, self.device)
        self.max_model_len = self._context_limit()
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.arch.eos_token_ids)
        # Structured outputs: grammars compiled for this tokenizer, shared by the server's
        # workers (which compile before a request is added) and the runner.
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size)
        draft = self._draft_source()
        # One rank: a ModelRunner. Tensor parallel: the driver of the group.
        self.runner: Executor = make_executor(
            config.parallel, mc, self.arch, source.weights, dtype=dtype, kv_dtype=kv_dtype,
            device=self.device, max_model_len=self.max_model_len, seed=mc.seed,
            eos_token_ids=self.eos_token_ids, grammars=self.grammars, draft=draft,
        )
        self.dtype = dtype
        block_size = config.cache.block_size
        num_blocks = self._size_kv_pool(block_size)
        self.runner.allocate_kv_cache(num_blocks, block_size)
        self.kv = KVCacheManager(
            num_blocks, block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            sliding_window=self._releasable_window(),
            # Keys change with anything that changes the KV: model, weights, dtypes.
            namespace=f"{self.model_name}|{mc.load_format}|{mc.seed}|{dtype}|{kv_dtype}|{mc.quantization}"
                      f"|{mc.quantization_group_size}|{mc.lm_head_quantization}",
        )
        self.scheduler: SchedulerBase = make_scheduler(config.scheduler, self.kv)
        self.request_factory = RequestFactory(self.tokenizer, self.arch.vocab_size, self.max_model_len,
                                               self.eos_token_ids, self.grammars)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.counters = EngineCounters()
        self.last_step: StepStats | None = None
        self.last_schedule: SchedulerOutput | None = None  # what that step ran (the live view reads it)
        self._phase_times = {"schedule": 0.0, "update+detokenize": 0.0}
        logger.info(
            "model %s (%s, %.1fM parameters, %s) on %s; KV pool %d blocks x %d tokens; context %d",
            self.model_name, self.arch.family, self.arch.num_parameters / 1e6, dtype,
            self.device, num_blocks, block_size, self.max_model_len,
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done at exit)."""
        self.runner.shutdown()

    # ---- set-up --------------------------------------------------------------------
    def _draft_source(self) -> ModelSource | None:
        """The draft model of speculative decoding, when it has one: same vocabulary."""
        name = self.config.scheduler.draft_model
        if name is None:
            return None
        source = open_model(name)
        if source.arch.vocab_size != self.arch.vocab_size:
            raise ValueError(f"the draft model {name} has a vocabulary of {source.arch.vocab_size} tokens, "
                             f"the model {self.arch.vocab_size}: they must share one")
        return source

    def _context_limit(self) -> int:
        limit = self.arch.max_position_embeddings
        requested = self.config.model.max_model_len
        if requested is not None:
            if requested < 2:
                raise ValueError("max_model_len must be at least 2")
            if requested > limit:
                raise ValueError(f"max_model_len {requested} exceeds the model's context {limit}")
            limit = requested
        return limit

    def _releasable_window(self) -> int | None:
        """The window behind which a request's KV blocks go back to the pool: where every layer
        slides by the same window (Mistral) and no draft model reads the same block tables with
        layers of its own. A model with full layers too (Gemma 3) shares one block table between
        both kinds, so it holds every block (docs/design.md, "Sliding windows and the block pool")."""
        windows = {self.arch.window_of(layer) for layer in range(self.arch.num_layers)}
        if len(windows) != 1 or None in windows or self.config.scheduler.speculative_method == "draft":
            return None
        return windows.pop()

    def _size_kv_pool(self, block_size: int) -> int:
        cache = self.config.cache
        per_block = self.runner.kv_bytes_per_block(block_size)
        if cache.num_kv_blocks is not None:
            num_blocks = cache.num_kv_blocks
        elif cache.kv_cache_bytes is not None:
            num_blocks = cache.kv_cache_bytes // per_block
        else:
            wanted = self.config.scheduler.max_num_seqs * blocks_for(self.max_model_len, block_size)
            affordable = int(_free_memory_bytes(self.device) * cache.kv_memory_share) // per_block
            num_blocks = max(min(wanted, affordable), blocks_for(self.max_model_len, block_size))
        if num_blocks < 1:
            raise ValueError("the KV cache size is too small for even one block")
        capacity = num_blocks * block_size
        if capacity < self.max_model_len:
            # Every admitted request must fit alone in the pool, or it could never finish.
            if self.config.model.max_model_len is not None:
                raise ValueError(
                    f"the KV pool holds {capacity} tokens, less than max_model_len "
                    f"{self.max_model_len}: give it more memory or lower max_model_len"
                )
            logger.warning("context capped at %d tokens, what the KV pool holds", capacity)
            self.max_model_len = capacity
        return num_blocks

    # ---- requests ------------------------------------------------------------------
    def make_request_id(self) -> str:
        return self.request_factory.make_request_id()

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and tokenise (``RequestFactory.make_request``); changes no engine state."""
        return self.request_factory.make_request(prompt, params, request_id, priority, cache_salt)

    def enqueue(self, req: Request) -> None:
        """Queue a request made by make_request (on the thread that steps the engine)."""
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        params = req.sampling_params
        detok = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens, prompt_token_ids=req.prompt_token_ids,
        )
        if req.output_token_ids:
            # A handed-off request: its first tokens' text is replayed, so that a stop string
            # that begins there is still found; what the engine that sampled them released
            # (the same text: the same tokenizer and stop strings) is not released again.
            detok.add_tokens(req.output_token_ids)
            detok.take_delta()
        self.detokenizers[req.request_id] = detok
        self.scheduler.add_request(req)
        self.counters.prompt_tokens += req.num_prompt_tokens

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        hand_off: bool = False,
    ) -> Request:
        """Validate and queue a request (``make_request``, then ``enqueue``).

        ``hand_off``: compute the prompt and the first token only; the finishing output
        then carries the request's KV (``RequestOutput.handoff``) for another engine's
        ``add_handoff`` to continue it (unless it already ended at its first token).
        """
        req = self.make_request(prompt, params, request_id, priority, cache_salt)
        if hand_off:
            self.prepare_handoff(req)
        self.enqueue(req)
        return req

    # ---- prefill/decode disaggregation ----------------------------------------------
    def prepare_handoff(self, req: Request) -> None:
        """Make a request from make_request stop after its first token and hand its KV over."""
        if self.config.scheduler.speculative_method == "draft":
            raise ValueError("a KV hand-off does not carry a draft model's cache")
        if self.config.parallel.tensor_parallel_size > 1:
            raise ValueError("a KV hand-off needs tensor_parallel_size 1")
        if req.max_tokens > 1:
            req.hand_off = True
            req.max_tokens = 1

    def _read_handoffs(self) -> dict[str, KVHandoff | str]:
        """Read out the KV of requests that finished their part here, then free their blocks
        (full ones stay in the prefix cache). A read that fails gives that request's error."""
        done: dict[str, KVHandoff | str] = {}
        for req in self.scheduler.take_handoffs():
            rid = req.request_id
            try:
                done[rid] = KVHandoff(rid, list(req.prompt_token_ids), list(req.output_token_ids),
                                      req.num_computed_tokens, self.kv.block_size,
                                      self.runner.read_kv_blocks(self.kv.block_ids(rid)), req.cache_salt)
            except Exception as exc:  # noqa: BLE001 - fail this request, not the step loop
                logger.exception("reading the KV of %s for its hand-off failed", rid)
                done[rid] = f"the KV hand-off failed: {exc!r}"
            finally:
                self.kv.free(rid)
        return done

    def add_handoff(self, handoff: KVHandoff, params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> Request:
        """Continue a request another engine prefilled: its blocks are allocated and filled
        here now, and it joins the queue as a decode. ``params`` are the request's own
        (the prefill engine stopped it after one token). Raises KVPoolFullError, changing
        nothing, when the pool has no room for it now (retry after a step)."""
        if handoff.block_size != self.kv.block_size:
            raise ValueError(f"handed-off blocks hold {handoff.block_size} tokens, this pool's {self.kv.block_size}")
        if handoff.kv_layout != KV_LAYOUT:
            raise ValueError(f"handed-off blocks are laid out as [{handoff.kv_layout}], this pool's as "
                             f"[{KV_LAYOUT}]: both engines must run the same version")
        req = self.make_request(handoff.prompt_token_ids, params, request_id or handoff.request_id, priority,
                                handoff.cache_salt)
        outputs = list(handoff.output_token_ids)
        if not outputs or len(outputs) >= req.max_tokens:
            raise ValueError("a hand-off continues a request that has sampled at least one token and "
                             "has more to sample")
        if handoff.num_computed_tokens != req.num_tokens + len(outputs) - 1:
            raise ValueError("a hand-off must hold the KV of every token but the last sampled")
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.output_token_ids = outputs
        if self.kv.allocate_slots(req, handoff.num_computed_tokens) is None:
            raise KVPoolFullError(f"no room for {handoff.num_computed_tokens} tokens of KV now")
        try:
            self.runner.write_kv_blocks(self.kv.block_ids(req.request_id), handoff.kv)
        except Exception:
            self.kv.free(req.request_id)
            raise
        req.num_computed_tokens = handoff.num_computed_tokens
        self.enqueue(req)
        return req

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [self._finish_output(req) for req in done]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def seconds_until_admission(self) -> float | None:
        """How long the scheduler holds waiting requests back with nobody running (dynamic
        batching); a step before then does nothing. None when it does not hold."""
        return self.scheduler.seconds_until_admission()

    def wait_for_admission(self, at_most_s: float | None = None) -> None:
        """Sleep while the scheduler holds its waiting requests back, at most ``at_most_s``:
        for a caller that steps the engine itself and adds no request meanwhile (the
        server's step loop waits on its command queue instead)."""
        if hold := self.seconds_until_admission():
            time.sleep(hold if at_most_s is None else min(hold, at_most_s))

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- one step ------------------------------------------------------------------
    @property
    def phase_times(self) -> dict[str, float]:
        """Seconds per phase of the step, summed since start: where a step's time goes."""
        return {**self._phase_times, **self.runner.phase_times}

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self._phase_times["schedule"] += time.perf_counter() - t0
        if out.is_empty:
            self.runner.execute(out)  # still apply freed ids
            return []
        try:
            result = self.runner.execute(out)
        except TensorParallelError:
            raise  # a worker is gone: the engine cannot go on
        except Exception as exc:  # a failed step must not take the other requests down
            # The runner may not have applied this step's changes: announce the freed ids
            # again, so it drops their state next step (dropping is idempotent).
            self.scheduler.return_freed(out.freed_request_ids)
            logger.error("step failed; failing its %d requests:\n%s",
                         len(out.num_scheduled_tokens), traceback.format_exc())
            return self._fail_step(list(out.num_scheduled_tokens), exc)
        t_update = time.perf_counter()
        # Requests the runner could not carry on end here; the update passes over them.
        outputs = self._fail_requests(result.failed)
        updated = self.scheduler.update_from_output(out, result)
        outputs += [self._tokens_output(req, toks) if toks else self._finish_output(req)
                    for req, toks in updated]
        if handoffs := self._read_handoffs():
            for o in outputs:  # not when a stop string ended it at its first token
                h = handoffs.get(o.request_id)
                if isinstance(h, str):
                    o.finish_reason, o.error = "error", h
                elif h is not None and o.finish_reason == "length":
                    o.handoff = h
        self._phase_times["update+detokenize"] += time.perf_counter() - t_update
        self._record_step(out, result, time.perf_counter() - t0)
        return outputs

    def _record_step(self, out: SchedulerOutput, result: RunnerOutput, duration: float) -> None:
        c = self.counters
        c.steps += 1
        c.preemptions += out.num_preempted
        c.computed_prompt_tokens += out.num_prefill_tokens
        sched = self.scheduler
        if sched.speculator is not None and not out.num_prefill_tokens:
            # What a decode or draft row costs a step, for the adaptive policy (prompt tokens
            # cost otherwise: no sampling, a different attention shape).
            sched.speculator.cost.observe(out.num_decodes, out.total_num_scheduled_tokens, duration)
        drafting = out.drafting_request_ids
        accepted = sum(max(len(result.tokens_of(rid)) - 1, 0) for rid in drafting)
        c.draft_tokens += out.num_draft_tokens
        c.accepted_draft_tokens += accepted
        c.speculative_steps += len(drafting)
        self.last_schedule = out
        self.last_step = StepStats(
            num_requests=len(out.num_scheduled_tokens), num_tokens=out.total_num_scheduled_tokens,
            num_prefill_tokens=out.num_prefill_tokens, num_decodes=out.num_decodes,
            num_preempted=out.num_preempted, num_running=self.num_running,
            num_waiting=self.num_waiting, kv_usage=self.kv.usage, duration_s=duration,
            num_draft_tokens=out.num_draft_tokens, num_accepted_draft_tokens=accepted,
            num_speculating=len(drafting),
        )

    def _tokens_output(self, req: Request, toks: list[SampledToken]) -> RequestOutput:
        """The output of a step that gave ``req`` these tokens (several under speculative
        decoding); a stop string among them ends the request there, and drops the rest."""
        detok = self.detokenizers[req.request_id]
        kept = []
        for i, tok in enumerate(toks):
            kept.append(tok)
            # A token that ended the request (EOS, stop token; always the last) is not text.
            ended_by_token = i == len(toks) - 1 and req.status == RequestStatus.FINISHED_STOPPED and not (
                req.sampling_params.include_stop_str_in_output and req.stop_reason is not None)
            stop_str = None if ended_by_token else detok.add_tokens([tok.token_id])
            if stop_str is not None:
                if dropped := len(toks) - 1 - i:
                    del req.output_token_ids[-dropped:]
                if req.status.finished:  # it also hit EOS or its length in this very token
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                req.stop_reason = stop_str
                break
        self.counters.generation_tokens += len(kept)
        new_ids = [tok.token_id for tok in kept]
        logprobs = [TokenLogprob(tok.token_id, tok.logprob, tok.top_logprobs or {})
                    for tok in kept if tok.logprob is not None]
        if req.status.finished:
            return self._finish_output(req, new_ids, logprobs)
        return self._output(req, new_ids, detok.take_delta(), logprobs)

    def _finish_output(self, req: Request, new_ids: list[int] | None = None,
                       logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        detok = self.detokenizers.pop(req.request_id)
        if req.hand_off and req.status == RequestStatus.FINISHED_LENGTH:
            # Its text goes on in another engine: a tail that may begin a stop string is held
            # back for that engine to release (or cut).
            delta = detok.take_delta()
        else:
            delta = detok.take_delta() + detok.flush()
        reason = req.status.finish_reason
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        return self._output(req, new_ids or [], delta, logprobs or [], detok.output_text)

    def _output(self, req: Request, new_ids, delta: str, logprobs, text: str | None = None) -> RequestOutput:
        detok_text = text if text is not None else self.detokenizers[req.request_id].output_text
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            text=detok_text,
            new_token_ids=new_ids,
            new_text=delta,
            new_logprobs=logprobs,
            finished=req.status.finished,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_prompt_tokens,
            num_preemptions=req.num_preemptions,
            times=req.times,
            prompt_logprobs=self._prompt_logprobs(req),
        )

    @staticmethod
    def _prompt_logprobs(req: Request) -> list[TokenLogprob | None] | None:
        """One entry per prompt token (None for the first, which nothing predicts), once the
        whole prompt has been computed; None when not asked for or not complete yet."""
        if req.sampling_params.prompt_logprobs is None or len(req.prompt_logprobs) < req.num_prompt_tokens - 1:
            return None
        return [None] + [TokenLogprob(t, lp, top, rank) for t, (lp, top, rank) in
                         zip(req.prompt_token_ids[1:], req.prompt_logprobs)]

    def _fail_step(self, request_ids: list[str], exc: Exception) -> list[RequestOutput]:
        return self._fail_requests({rid: f"{type(exc).__name__}: {exc}" for rid in request_ids})

    def _fail_requests(self, errors: dict[str, str]) -> list[RequestOutput]:
        """End the requests of ``errors`` (request id -> why) with finish_reason "error"."""
        if not errors:
            return []
        outputs = []
        for req in self.scheduler.finish_requests(list(errors), RequestStatus.FINISHED_ERROR):
            o = self._finish_output(req)
            o.error = errors[req.request_id]
            outputs.append(o)
        return outputs


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 << 30
