"""LLMEngine: add requests, step, abort. One step = schedule, run the model on the
flat batch, sample, update requests, detokenise, and report what changed."""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque

import torch

from travelator.config import EngineConfig
from travelator.engine.tp_executor import TensorParallelError, make_executor
from travelator.errors import InvalidRequestError
from travelator.engine.executor import Executor, PipelinedExecutor
from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.engine.block_manager import KVCacheManager, blocks_for
from travelator.engine.kv_event_publisher import KVEventStream
from travelator.engine.kv_handoff import KVHandoff, KVHandoffs
from travelator.engine.kv_profile import LargestStep, device_memory_stats, profile_memory
from travelator.engine.kv_sizing import MemoryProfile, kv_pool_blocks
from travelator.engine.model_runner import RunnerSettings
from travelator.engine.output_processor import OutputProcessor
from travelator.engine.outputs import RequestOutput
from travelator.engine.request import Request, RequestSpec, RequestStatus
from travelator.engine.request_factory import RequestFactory
from travelator.engine.scheduler import SchedulerBase
from travelator.engine.scheduler_factory import make_scheduler
from travelator.engine.scheduler_output import RunnerOutput, SampledToken, SchedulerOutput
from travelator.engine.step_stats import EngineCounters, StepStats
from travelator.model.device import halved_note, pick_device, resolve_dtype, resolve_kv_dtype
from travelator.model.host_memory import available_bytes
from travelator.model.loader import ModelSource, open_model
from travelator.model.ops import native_kernels_chosen
from travelator.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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
        dtype = resolve_dtype(mc.dtype, self.device, native_cpu_kernels=native_kernels_chosen(mc.kernels, self.device))
        kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype, self.device)
        self.max_model_len = self._context_limit()
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.arch.eos_token_ids)
        # Structured outputs: grammars compiled for this tokenizer, shared by the server's
        # workers (which compile before a request is added) and the runner.
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size)
        draft = self._draft_source()
        # One rank: a ModelRunner. Tensor parallel: the driver of the group.
        settings = RunnerSettings(dtype, kv_dtype, self.device, self.max_model_len, self.eos_token_ids,
                                  config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
        self.runner: Executor = make_executor(config.parallel, mc, self.arch, source.weights, settings,
                                              grammars=self.grammars, draft=draft)
        self.dtype = dtype
        block_size = config.cache.block_size
        self.memory_profile: MemoryProfile | None = None  # what start-up measured on a GPU
        num_blocks = self._size_kv_pool(block_size)
        self.runner.allocate_kv_cache(num_blocks, block_size)
        self.kv_events, self.kv = self._kv_cache_manager(num_blocks, block_size, kv_dtype)
        self.scheduler: SchedulerBase = make_scheduler(config.scheduler, self.kv)
        self.request_factory = RequestFactory(self.tokenizer, self.arch.vocab_size, self.max_model_len,
                                               self.eos_token_ids, self.grammars)
        self.counters = EngineCounters()
        self.output_processor = OutputProcessor(self.tokenizer, self.counters)
        self.handoffs = KVHandoffs(config, self.scheduler, self.kv, self.runner)
        self.last_step: StepStats | None = None
        self.last_schedule: SchedulerOutput | None = None  # what that step ran (the live view reads it)
        self._phase_times = {"schedule": 0.0, "update+detokenize": 0.0}
        # Pipeline parallelism: steps sent through the stages whose tokens are not back yet.
        self._flights: deque[SchedulerOutput] = deque()
        self.steps_in_flight = 1
        self.set_steps_in_flight(config.parallel.pipeline_parallel_size)
        # What the defaults chose here: the line LLM and the CLI print once at start-up.
        self.summary = (f"model {self.model_name} ({self.arch.family}, {self.arch.num_parameters / 1e6:.1f}M "
                        f"parameters): {self.runner.describe()}{halved_note(mc.dtype, source.checkpoint_dtype, dtype)}; KV pool {num_blocks} blocks x {block_size} "
                        f"tokens; context {self.max_model_len}")
        logger.info("%s", self.summary)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and the KV event publisher (idempotent;
        the workers are also stopped at exit)."""
        self.runner.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
            self.kv_events = None

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

    def _kv_cache_manager(self, num_blocks: int, block_size: int,
                          kv_dtype: torch.dtype) -> tuple[KVEventStream | None, KVCacheManager]:
        """The pool's bookkeeping, and its event stream when KV events are on."""
        mc, cache = self.config.model, self.config.cache
        events = cache.kv_events()
        # Off by default: the prefix cache's changes for cluster routers (engine/kv_events.py).
        stream = None if events is None else KVEventStream(events, block_size)
        kv = KVCacheManager(
            num_blocks, block_size,
            enable_prefix_caching=cache.enable_prefix_caching,
            sliding_window=self._releasable_window(),
            listener=None if stream is None else stream.recorder,
            # Keys change with anything that changes the KV: model, weights, dtypes.
            namespace=f"{self.model_name}|{mc.load_format}|{mc.seed}|{self.dtype}|{kv_dtype}|{mc.quantization}"
                      f"|{mc.quantization_group_size}|{mc.lm_head_quantization}",
        )
        return stream, kv

    def _size_kv_pool(self, block_size: int) -> int:
        cache = self.config.cache
        per_block = self.runner.kv_bytes_per_block(block_size)
        stats = device_memory_stats(self.device)
        if cache.num_kv_blocks is not None:
            num_blocks = cache.num_kv_blocks
        elif cache.kv_cache_bytes is not None:
            num_blocks = cache.kv_cache_bytes // per_block
        elif stats is not None:  # a GPU server's sizing: what its memory share leaves
            sched = self.config.scheduler
            step = LargestStep(sched.max_num_batched_tokens, sched.max_num_seqs, self.max_model_len,
                               block_size)
            profile = self.memory_profile = profile_memory(self.runner, stats, step)
            logger.info("device memory: %s", profile)
            num_blocks = kv_pool_blocks(cache.gpu_memory_utilization, profile, per_block, block_size,
                                        self.max_model_len)
        else:
            wanted = self.config.scheduler.max_num_seqs * blocks_for(self.max_model_len, block_size)
            affordable = int(_free_memory_bytes() * cache.kv_memory_share) // per_block
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

    def make_request(self, spec: RequestSpec) -> Request:
        """Validate and tokenise (``RequestFactory.make_request``); changes no engine state."""
        pooling = spec.params.pooling
        if pooling is not None and pooling.task == "embed" and self.config.parallel.pipeline_parallel_size > 1:
            # The final hidden states stay on the last stage; only sampled rows' logits come back.
            raise InvalidRequestError("embeddings need pipeline_parallel_size 1", "pooling")
        return self.request_factory.make_request(spec)

    def enqueue(self, req: Request) -> None:
        """Queue a request made by make_request (on the thread that steps the engine)."""
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.output_processor.add_request(req)
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
        req = self.make_request(RequestSpec(prompt, params or SamplingParams(), request_id, priority,
                                             cache_salt))
        if hand_off:
            self.handoffs.prepare(req)
        self.enqueue(req)
        return req

    # ---- prefill/decode disaggregation ----------------------------------------------
    def add_handoff(self, handoff: KVHandoff, params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> Request:
        """Continue a request another engine prefilled: its blocks are allocated and filled
        here now, and it joins the queue as a decode. ``params`` are the request's own
        (the prefill engine stopped it after one token). Raises KVPoolFullError, changing
        nothing, when the pool has no room for it now (retry after a step)."""
        req = self.make_request(RequestSpec(handoff.prompt_token_ids, params,
                                            request_id or handoff.request_id, priority, handoff.cache_salt))
        self.handoffs.place(handoff, req)
        self.enqueue(req)
        return req

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [self.output_processor.finish_output(req) for req in done]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._flights)

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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, when no request holds a block; returns whether it did."""
        done = self.kv.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()
        return done

    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        finally:
            if self.kv_events is not None:  # this step's changes to the cache, as one batch
                self.kv_events.flush()

    def set_steps_in_flight(self, n: int) -> None:
        """Keep up to ``n`` steps in flight, at most one per pipeline stage (Orca's micro-batches:
        each stage computes one while the others compute theirs); 1: one step at a time, as
        every other mode runs. A pipeline keeps one per stage unless told otherwise."""
        stages = self.config.parallel.pipeline_parallel_size
        if not 1 <= n <= stages:
            raise ValueError(f"steps in flight must be from 1 to the {stages} pipeline stage(s)")
        if self._flights:
            raise RuntimeError("steps are in flight: change how many between runs")
        self.steps_in_flight = n
        self.scheduler.set_micro_batches(n)

    def _step(self) -> list[RequestOutput]:
        if self.steps_in_flight > 1:
            return self._pipelined_step()
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
        return self._update(out, result, t0)

    def _pipelined_step(self) -> list[RequestOutput]:
        """Send steps through the stages while fewer than ``steps_in_flight`` are out (each over
        requests in none of them), then land the oldest. A stage that fails breaks the engine
        (TensorParallelError), as with one step at a time."""
        t0 = time.perf_counter()
        runner: PipelinedExecutor = self.runner  # a pipeline's driver (make_executor)
        while len(self._flights) < self.steps_in_flight:
            t_schedule = time.perf_counter()
            out = self.scheduler.schedule()
            self._phase_times["schedule"] += time.perf_counter() - t_schedule
            if out.is_empty:
                if self._flights:  # the runner hears of the freed ids with the next step
                    self.scheduler.return_freed(out.freed_request_ids)
                else:
                    runner.execute(out)
                break
            self.scheduler.start_flight(out)
            runner.launch(out)
            self._flights.append(out)
        if not self._flights:
            return []
        out = self._flights.popleft()
        return self._update(out, runner.land(), t0)

    def _update(self, out: SchedulerOutput, result: RunnerOutput, t0: float) -> list[RequestOutput]:
        """Advance the step's requests by its result and make their outputs."""
        t_update = time.perf_counter()
        # Requests the runner could not carry on end here; the update passes over them.
        outputs = self._fail_requests(result.failed)
        updated = self.scheduler.update_from_output(out, result)
        outputs += [self._step_output(req, toks) for req, toks in updated]
        self.handoffs.attach(outputs)
        self._phase_times["update+detokenize"] += time.perf_counter() - t_update
        self._record_step(out, outputs, time.perf_counter() - t0)
        return outputs

    def _step_output(self, req: Request, toks: list[SampledToken]) -> RequestOutput:
        """Decide whether ``req`` stops among the tokens it got (the scheduler learns it
        here, once), and make its output."""
        kept, stop = self.output_processor.find_stop(req, toks)
        if stop is not None:
            self.scheduler.stop_request(req, len(toks) - kept, stop)
        return self.output_processor.step_output(req, toks[:kept])

    def _record_step(self, out: SchedulerOutput, outputs: list[RequestOutput], duration: float) -> None:
        c = self.counters
        c.steps += 1
        c.preemptions += out.num_preempted
        c.computed_prompt_tokens += out.num_prefill_tokens
        sched = self.scheduler
        if sched.speculator is not None and not out.num_prefill_tokens:
            # What a decode or draft row costs a step, for the adaptive policy (prompt tokens
            # cost otherwise: no sampling, a different attention shape).
            sched.speculator.cost.observe(out.num_decodes, out.total_num_scheduled_tokens, duration)
        drafting = out.drafts
        # Drafts accepted: the tokens a drafting request kept beyond its own sample.
        accepted = sum(max(len(o.new_token_ids) - 1, 0) for o in outputs if o.request_id in drafting)
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

    def _fail_step(self, request_ids: list[str], exc: Exception) -> list[RequestOutput]:
        return self._fail_requests({rid: f"{type(exc).__name__}: {exc}" for rid in request_ids})

    def _fail_requests(self, errors: dict[str, str]) -> list[RequestOutput]:
        """End the requests of ``errors`` (request id -> why) with finish_reason "error"."""
        if not errors:
            return []
        outputs = []
        for req in self.scheduler.finish_requests(list(errors), RequestStatus.FINISHED_ERROR):
            o = self.output_processor.finish_output(req)
            o.error = errors[req.request_id]
            outputs.append(o)
        return outputs


def _free_memory_bytes() -> int:
    """The host memory new allocations can take, a container's memory limit respected: what
    the CPU's KV pool takes a share of (CUDA is profiled instead); 4 GiB where nothing says."""
    available = available_bytes()
    return 4 << 30 if available is None else available
