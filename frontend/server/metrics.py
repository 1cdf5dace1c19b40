"""Prometheus metrics of one server (frontend process, HTTP server).

A registry per application, no global state: gauges are read from the core (`get_engine_stats`) when
/metrics is scraped, counters and histograms are fed by the handlers through a RequestTimer per engine
request. prometheus_client writes the text format.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.num_running = Gauge("coreserve:num_requests_running", "Requests in the core's batch", registry=r)
        self.num_waiting = Gauge("coreserve:num_requests_waiting", "Requests queued in the core", registry=r)
        self.kv_blocks_free = Gauge("coreserve:kv_blocks_free", "Free KV cache blocks", registry=r)
        self.kv_blocks_total = Gauge("coreserve:kv_blocks_total", "KV cache blocks in all", registry=r)
        self.num_preemptions = Gauge(
            "coreserve:num_preemptions", "Preemptions since the core started", registry=r
        )
        self.prompt_tokens = Counter("coreserve:prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("coreserve:generation_tokens", "Tokens generated", registry=r)
        self.num_finished = Counter(
            "coreserve:request_success", "Engine requests finished", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "coreserve:time_to_first_token_seconds",
            "From arrival to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_counters = EngineCounters()
        r.register(self.engine_counters)
        self.tpot = Histogram(
            "coreserve:time_per_output_token_seconds",
            "Mean time between a request's tokens after the first",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    async def render(self, engine) -> bytes:
        stats = await engine.get_engine_stats()
        self.engine_counters.stats = stats
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_blocks_free.set(stats.num_free_kv_blocks)
        self.kv_blocks_total.set(stats.num_kv_blocks)
        self.num_preemptions.set(stats.num_preemptions)
        return generate_latest(self.registry)

    def render_local(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, num_prompt_tokens: int, num_completions: int) -> RequestTimer:
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self, num_completions)


class EngineCounters:
    """Counters the core keeps (prefix cache queries and hits, in tokens, as vLLM counts them), exposed
    as Prometheus counters from the latest stats taken at scrape time."""

    def __init__(self) -> None:
        self.stats = None

    def collect(self):
        queries = CounterMetricFamily(
            "coreserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        hits = CounterMetricFamily("coreserve:prefix_cache_hits", "Prompt tokens read from the prefix cache")
        cached = GaugeMetricFamily("coreserve:prefix_cache_blocks", "KV blocks the prefix cache indexes")
        if self.stats is not None:
            queries.add_metric([], self.stats.prefix_cache_queries)
            hits.add_metric([], self.stats.prefix_cache_hits)
            cached.add_metric([], self.stats.num_cached_blocks)
        return [queries, hits, cached, *self._speculation()]

    def _speculation(self) -> list:
        """Speculative decoding's counters under vLLM's names (`vllm:spec_decode_*`), where it is on:
        acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts."""
        stats = self.stats
        if stats is None or not stats.spec_accepted_per_position:
            return []
        families = []
        for name, value, text in (
            ("num_drafts", stats.spec_num_drafts, "Verified rounds with at least one proposed token"),
            ("num_draft_tokens", stats.spec_num_draft_tokens, "Tokens proposed and verified"),
            ("num_accepted_tokens", stats.spec_num_accepted_tokens, "Proposed tokens kept"),
        ):
            family = CounterMetricFamily(f"vllm:spec_decode_{name}", text)
            family.add_metric([], value)
            families.append(family)
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens kept, by proposal position",
            labels=["position"],
        )
        for position, value in enumerate(stats.spec_accepted_per_position):
            per_position.add_metric([str(position)], value)
        return [*families, per_position]

    def describe(self):
        return []


class RequestTimer:
    """One engine request's latencies: time to first token from arrival, then time per output token."""

    def __init__(self, metrics: ServerMetrics, num_completions: int) -> None:
        self.metrics = metrics
        self.num_completions = num_completions
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.num_tokens = 0

    def on_tokens(self, num_new: int) -> None:
        if num_new and self.first_token is None:
            self.first_token = time.perf_counter()
            self.metrics.ttft.observe(self.first_token - self.arrival)
        self.num_tokens += num_new
        self.metrics.generation_tokens.inc(num_new)

    def on_finish(self, finish_reasons: list[str | None]) -> None:
        per_completion = self.num_tokens / self.num_completions  # n > 1: completions decode side by side
        if self.first_token is not None and per_completion > 1:
            self.metrics.tpot.observe((time.perf_counter() - self.first_token) / (per_completion - 1))
        for reason in finish_reasons:
            self.metrics.num_finished.labels(finish_reason=str(reason)).inc()
