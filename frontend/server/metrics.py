"""Prometheus metrics of one server (frontend process, HTTP server).

A registry per application, no global state: gauges are read from the core (`get_engine_stats`) when
/metrics is scraped, counters and histograms are fed by the handlers through a RequestTimer per engine
request. prometheus_client writes the text format.

Each figure is there twice: under `coreserve:*`, and under vLLM's name with its `model_name` and
`engine` labels (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`,
...), which routers (vllm-router, sglang-router, llm-d's gateway), autoscalers and prime-rl's
concurrency controller read (docs/serving.md).
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
        self.vllm = VllmGauges()
        r.register(self.vllm)
        labels = ["model_name", "engine"]
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens received", labels, registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels, registry=r)
        self.vllm_finished = Counter(
            "vllm:request_success", "Engine requests finished", [*labels, "finished_reason"], registry=r
        )
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "From arrival to the first token", labels,
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time between a request's tokens",
                                   labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.labels = {"model_name": "", "engine": "0"}
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

    def name(self, served_model_name: str, engine) -> None:
        """The served model's name in vLLM's `model_name` label, and the engine's cache configuration."""
        self.labels["model_name"] = served_model_name
        self.vllm.labels = dict(self.labels)
        self.vllm.config = engine.config

    async def render(self, engine) -> bytes:
        stats = await engine.get_engine_stats()
        self.engine_counters.stats = self.vllm.stats = stats
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
        self.vllm_prompt_tokens.labels(**self.labels).inc(num_prompt_tokens)
        return RequestTimer(self, num_completions)


class VllmGauges:
    """The core's state at scrape time under vLLM's names: requests running and waiting, the KV cache's
    use (1 - free blocks / blocks, the prefix cache's unheld blocks counted free, as vLLM's block pool
    counts them), preemptions and prefix-cache tokens as counters, and `vllm:cache_config_info` (1, the
    configuration in its labels)."""

    def __init__(self) -> None:
        self.stats = None
        self.labels: dict[str, str] = {"model_name": "", "engine": "0"}
        self.config = None

    def collect(self):
        stats, names, values = self.stats, list(self.labels), list(self.labels.values())
        if stats is None:
            return []
        usage = 1.0 - stats.num_free_kv_blocks / stats.num_kv_blocks if stats.num_kv_blocks else 0.0
        families = []
        for kind, name, text, value in (
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the engine's batch", stats.num_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests queued in the engine", stats.num_waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV cache use, 0 to 1", usage),
            (CounterMetricFamily, "vllm:num_preemptions", "Preemptions since the engine started", stats.num_preemptions),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up", stats.prefix_cache_queries),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens read from the cache", stats.prefix_cache_hits),
        ):
            family = kind(name, text, labels=names)
            family.add_metric(values, value)
            families.append(family)
        if self.config is not None:
            cache = {
                "block_size": str(self.config.block_size), "num_gpu_blocks": str(stats.num_kv_blocks),
                "num_cpu_blocks": "0", "enable_prefix_caching": str(self.config.enable_prefix_caching),
                "cache_dtype": "auto",
            }
            info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration", labels=[*names, *cache])
            info.add_metric([*values, *cache.values()], 1.0)
            families.append(info)
        return families

    def describe(self):
        return []


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
            self.metrics.vllm_ttft.labels(**self.metrics.labels).observe(self.first_token - self.arrival)
        self.num_tokens += num_new
        self.metrics.generation_tokens.inc(num_new)
        if num_new:
            self.metrics.vllm_generation_tokens.labels(**self.metrics.labels).inc(num_new)

    def on_finish(self, finish_reasons: list[str | None]) -> None:
        per_completion = self.num_tokens / self.num_completions  # n > 1: completions decode side by side
        if self.first_token is not None and per_completion > 1:
            tpot = (time.perf_counter() - self.first_token) / (per_completion - 1)
            self.metrics.tpot.observe(tpot)
            self.metrics.vllm_tpot.labels(**self.metrics.labels).observe(tpot)
        for reason in finish_reasons:
            self.metrics.num_finished.labels(finish_reason=str(reason)).inc()
            self.metrics.vllm_finished.labels(**self.metrics.labels, finished_reason=str(reason)).inc()
