"""Prometheus metrics of one server, in its own registry (no global state).

Two sources:

- the engine's figures, from one ``EngineSnapshot`` per scrape (``EngineClient.snapshot``):
  gauges (running and waiting requests, KV blocks) and counters (tokens, steps, prefix
  cache, finished requests), right even when the engine is idle and no step reports anything;
- histograms fed by a step listener (batch size per step, tokens per step, step time,
  and per finished request: time to first token, time per output token, end-to-end
  latency, queue time).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from travelator.engine.client import EngineClient, EngineSnapshot, StepStats
from travelator.engine.outputs import RequestOutput

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_PREFIX = "travelator"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0)
_POW2 = tuple(float(2**i) for i in range(14))


class _EngineFigures:
    """The engine's gauges and counters, from one snapshot taken at scrape time."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def _family(self, kind, name: str, doc: str, value: float):
        fam = kind(f"{_PREFIX}_{name}", doc, labels=["model_name"])
        fam.add_metric([self.model_name], value)
        return fam

    def collect(self):
        client, snap = self.client, self.client.snapshot()
        yield from self._gauges(snap)
        yield self._family(GaugeMetricFamily, "engine_healthy", "1 while the step loop runs, 0 once it has died.",
                           1.0 if client.healthy else 0.0)
        yield self._family(GaugeMetricFamily, "engine_step_running_seconds",
                           "How long the step now running has run (0 between steps).", client.step_running_for())
        yield from self._counters(snap)
        fam = CounterMetricFamily(f"{_PREFIX}_request_success", "Requests finished, by finish reason.",
                                  labels=["model_name", "finished_reason"])
        finished = dict(snap.counters.finished)
        for reason in ("stop", "length", "abort", "error"):
            finished.setdefault(reason, 0)
        for reason, count in sorted(finished.items()):
            fam.add_metric([self.model_name, reason], count)
        yield fam

    def _gauges(self, snap: EngineSnapshot):
        gauge = GaugeMetricFamily
        yield self._family(gauge, "num_requests_running", "Requests in the running batch.", snap.num_running)
        yield self._family(gauge, "num_requests_waiting",
                           "Requests waiting to be scheduled (preempted ones included).", snap.num_waiting)
        yield self._family(gauge, "num_requests_in_flight",
                           "Requests the server has handed to the engine and not seen finish.",
                           snap.num_in_flight)
        yield self._family(gauge, "kv_cache_usage", "Share of the KV cache blocks in use (0 to 1).",
                           snap.kv_usage)
        yield self._family(gauge, "kv_cache_used_blocks", "KV cache blocks in use.", snap.kv_used_blocks)
        yield self._family(gauge, "kv_cache_total_blocks", "KV cache blocks in the pool.", snap.kv_total_blocks)
        yield self._family(gauge, "kv_cache_free_blocks", "KV cache blocks free (counted apart from the used ones).",
                           snap.kv_free_blocks)
        yield self._family(gauge, "kv_cache_cached_blocks", "KV blocks holding a reusable prefix (in use or free).",
                           snap.kv_cached_blocks)

    def _counters(self, snap: EngineSnapshot):
        c, counter = snap.counters, CounterMetricFamily
        yield self._family(counter, "prompt_tokens", "Prompt tokens of admitted requests (each counted once).",
                           c.prompt_tokens)
        yield self._family(counter, "computed_prompt_tokens",
                           "Prompt tokens computed, recomputation after preemption included.",
                           c.computed_prompt_tokens)
        yield self._family(counter, "generation_tokens", "Tokens generated.", c.generation_tokens)
        yield self._family(counter, "num_preemptions",
                           "Requests preempted (their KV blocks freed for recompute).", c.preemptions)
        yield self._family(counter, "engine_steps", "Engine steps run.", c.steps)
        # Speculative decoding: acceptance rate = accepted / draft; mean accepted length
        # = accepted / speculative_steps.
        yield self._family(counter, "spec_draft_tokens", "Draft tokens verified (speculative decoding).",
                           c.draft_tokens)
        yield self._family(counter, "spec_accepted_tokens", "Draft tokens accepted.", c.accepted_draft_tokens)
        yield self._family(counter, "spec_steps", "Request-steps that verified drafts.", c.speculative_steps)
        yield self._family(counter, "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
                           snap.prefix_queried_tokens)
        yield self._family(counter, "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.",
                           snap.prefix_hit_tokens)


class ServerMetrics:
    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        name = model_name
        lbl = ["model_name"]
        reg.register(_EngineFigures(client, name))
        for collector in client.metric_collectors:
            reg.register(collector)

        self._batch_size = Histogram(f"{_PREFIX}_batch_size", "Requests scheduled per step.", lbl,
                                     buckets=_POW2, registry=reg).labels(name)
        self._batch_tokens = Histogram(f"{_PREFIX}_batch_tokens", "Tokens computed per step.", lbl,
                                       buckets=_POW2, registry=reg).labels(name)
        self._step_time = Histogram(f"{_PREFIX}_step_duration_seconds", "Wall time of one step.", lbl,
                                    buckets=_LATENCY_BUCKETS, registry=reg).labels(name)
        self._ttft = Histogram(f"{_PREFIX}_time_to_first_token_seconds",
                               "From arrival to the first generated token.", lbl,
                               buckets=_LATENCY_BUCKETS, registry=reg).labels(name)
        self._tpot = Histogram(f"{_PREFIX}_time_per_output_token_seconds",
                               "Mean time between output tokens of a finished request.", lbl,
                               buckets=_TPOT_BUCKETS, registry=reg).labels(name)
        self._e2e = Histogram(f"{_PREFIX}_e2e_request_latency_seconds",
                              "From arrival to finish, for requests that finished in a step.", lbl,
                              buckets=_LATENCY_BUCKETS, registry=reg).labels(name)
        self._queue = Histogram(f"{_PREFIX}_request_queue_time_seconds",
                                "From arrival to first scheduled.", lbl,
                                buckets=_LATENCY_BUCKETS, registry=reg).labels(name)
        self._rejected = Counter(f"{_PREFIX}_requests_rejected", "Requests refused before reaching the engine.",
                                 ["model_name", "reason"], registry=reg)
        self._model_name = name
        self.num_rejected = 0  # the counter's total, for the live view

    # Runs on the step thread after each step: quick, and prometheus-client is thread-safe.
    def on_step(self, stats: StepStats, outputs: list[RequestOutput]) -> None:
        self._batch_size.observe(stats.num_requests)
        self._batch_tokens.observe(stats.num_tokens)
        self._step_time.observe(stats.duration_s)
        for out in outputs:
            if out.finished and out.times is not None:
                self._observe_finished(out)

    def _observe_finished(self, out: RequestOutput) -> None:
        t = out.times
        end = t.finished or t.last_token
        if t.first_token is not None:
            self._ttft.observe(t.first_token - t.arrival)
            n = len(out.output_token_ids)
            if n > 1 and t.last_token is not None:
                self._tpot.observe((t.last_token - t.first_token) / (n - 1))
        if t.first_scheduled is not None:
            self._queue.observe(t.first_scheduled - t.arrival)
        if end is not None:
            self._e2e.observe(end - t.arrival)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self._model_name, reason).inc()
        self.num_rejected += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
