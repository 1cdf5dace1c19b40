"""Prometheus metrics of one server (frontend process, HTTP server): one table of rows, one collector
that writes every row twice, under `coreserve:*` and under vLLM's name with its `model_name` and
`engine` labels (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`,
...), which routers (vllm-router, sglang-router, llm-d's gateway), autoscalers and prime-rl's
concurrency controller read (docs/serving.md).

A registry per application, no global state. Rows with a `read` take the core's stats
(`get_engine_stats`) when /metrics is scraped; the others are fed by the handlers through a
RequestTimer per engine request and kept here. prometheus_client writes the text format.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIXES = ("coreserve", "vllm")
VLLM_LABELS = ("model_name", "engine")
LABEL_NAMES = {"vllm": {"finish_reason": "finished_reason"}}  # vLLM's spelling of a row's label
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)


def _usage(stats) -> float:
    """1 - free blocks / blocks: the prefix cache's unheld blocks count free, as vLLM's block pool counts."""
    return 1.0 - stats.num_free_kv_blocks / stats.num_kv_blocks if stats.num_kv_blocks else 0.0


@dataclass(frozen=True)
class Row:
    name: str  # after the prefix
    kind: str  # "gauge", "counter" or "histogram"
    text: str
    read: Callable | None = None  # stats -> value at scrape time; None: fed by requests
    labels: tuple[str, ...] = ()


METRICS = (
    Row("num_requests_running", "gauge", "Requests in the engine's batch", lambda s: s.num_running),
    Row("num_requests_waiting", "gauge", "Requests queued in the engine", lambda s: s.num_waiting),
    Row("kv_blocks_free", "gauge", "Free KV cache blocks", lambda s: s.num_free_kv_blocks),
    Row("kv_blocks_total", "gauge", "KV cache blocks in all", lambda s: s.num_kv_blocks),
    Row("kv_cache_usage_perc", "gauge", "KV cache use, 0 to 1", _usage),
    Row("num_preemptions", "counter", "Preemptions since the engine started", lambda s: s.num_preemptions),
    Row("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache",
        lambda s: s.prefix_cache_queries),
    Row("prefix_cache_hits", "counter", "Prompt tokens read from the prefix cache", lambda s: s.prefix_cache_hits),
    Row("prefix_cache_blocks", "gauge", "KV blocks the prefix cache indexes", lambda s: s.num_cached_blocks),
    Row("prompt_tokens", "counter", "Prompt tokens received"),
    Row("generation_tokens", "counter", "Tokens generated"),
    Row("request_success", "counter", "Engine requests finished", labels=("finish_reason",)),
    Row("time_to_first_token_seconds", "histogram", "From arrival to the first token"),
    Row("time_per_output_token_seconds", "histogram", "Mean time between a request's tokens after the first"),
)
# Speculative decoding's counters, where it is on: acceptance rate = accepted / draft tokens; mean
# accepted length = 1 + accepted / drafts
SPECULATION = (
    Row("spec_decode_num_drafts", "counter", "Verified rounds with at least one proposed token",
        lambda s: s.spec_num_drafts),
    Row("spec_decode_num_draft_tokens", "counter", "Tokens proposed and verified", lambda s: s.spec_num_draft_tokens),
    Row("spec_decode_num_accepted_tokens", "counter", "Proposed tokens kept", lambda s: s.spec_num_accepted_tokens),
)
_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


class ServerMetrics:
    """The collector: every row of METRICS under each prefix, from the latest stats and the request
    figures kept here (counters by label values; histograms as bucket counts and a sum)."""

    def __init__(self) -> None:
        self.stats = None
        self.config = None
        self.vllm_values = ["", "0"]  # model_name, engine
        self.counts: dict[str, dict[tuple, float]] = {r.name: {} for r in METRICS if r.kind == "counter"}
        self.histograms = {r.name: Histogram() for r in METRICS if r.kind == "histogram"}
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    def name(self, served_model_name: str, engine) -> None:
        """The served model's name in vLLM's `model_name` label, and the engine's cache configuration."""
        self.vllm_values[0] = served_model_name
        self.config = engine.config

    async def render(self, engine) -> bytes:
        self.stats = await engine.get_engine_stats()
        return generate_latest(self.registry)

    def render_local(self) -> bytes:
        """The figures kept here; the core's keep their last scraped values (the engine is gone)."""
        return generate_latest(self.registry)

    def count(self, name: str, value: float, *label_values: str) -> None:
        counts = self.counts[name]
        counts[label_values] = counts.get(label_values, 0.0) + value

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def timer(self, num_prompt_tokens: int, num_completions: int) -> RequestTimer:
        self.count("prompt_tokens", num_prompt_tokens)
        return RequestTimer(self, num_completions)

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        families = []
        for prefix in PREFIXES:
            for row in METRICS:
                if row.read is None or self.stats is not None:
                    families.append(self._family(prefix, row))
            if self.stats is not None:
                families += self._speculation(prefix) + self._cache_config(prefix) + self._lora_info(prefix)
        return families

    def _family(self, prefix: str, row: Row):
        base, values = self._labels(prefix)
        names = [*base, *(LABEL_NAMES.get(prefix, {}).get(label, label) for label in row.labels)]
        if row.kind == "histogram":
            family = HistogramMetricFamily(f"{prefix}:{row.name}", row.text, labels=names)
            histogram = self.histograms[row.name]
            family.add_metric(values, histogram.buckets(), histogram.total)
        else:
            family = _FAMILIES[row.kind](f"{prefix}:{row.name}", row.text, labels=names)
            readings = {(): row.read(self.stats)} if row.read is not None else self.counts[row.name]
            if not readings and not row.labels:  # an unlabelled counter reads 0 before its first request
                readings = {(): 0.0}
            for label_values, value in readings.items():
                family.add_metric([*values, *label_values], value)
        return family

    def _labels(self, prefix: str) -> tuple[list[str], list[str]]:
        return (list(VLLM_LABELS), list(self.vllm_values)) if prefix == "vllm" else ([], [])

    def _speculation(self, prefix: str) -> list:
        if not self.stats.spec_accepted_per_position:
            return []
        families = [self._family(prefix, row) for row in SPECULATION]
        per_position = CounterMetricFamily(f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                                           "Proposed tokens kept, by proposal position", labels=["position"])
        for position, value in enumerate(self.stats.spec_accepted_per_position):
            per_position.add_metric([str(position)], value)
        return [*families, per_position]

    def _cache_config(self, prefix: str) -> list:
        """`*:cache_config_info`: 1, the KV cache's configuration in its labels."""
        if self.config is None:
            return []
        base, values = self._labels(prefix)
        cache = {
            "block_size": str(self.config.block_size), "num_gpu_blocks": str(self.stats.num_kv_blocks),
            "num_cpu_blocks": "0", "enable_prefix_caching": str(self.config.enable_prefix_caching),
            "cache_dtype": "auto",
        }
        info = GaugeMetricFamily(f"{prefix}:cache_config_info", "The KV cache's configuration", labels=[*base, *cache])
        info.add_metric([*values, *cache.values()], 1.0)
        return [info]


    def _lora_info(self, prefix: str) -> list:
        """`*:lora_requests_info` (with LoRA on): the time of the scrape, the adapters of the running and
        waiting requests and max_loras in its labels, as vLLM writes it."""
        if self.config is None or not self.config.enable_lora:
            return []
        base, values = self._labels(prefix)
        labels = {"max_lora": str(self.config.max_loras),
                  "running_lora_adapters": ",".join(self.stats.running_lora_adapters),
                  "waiting_lora_adapters": ",".join(self.stats.waiting_lora_adapters)}
        info = GaugeMetricFamily(f"{prefix}:lora_requests_info", "Running and waiting LoRA adapters",
                                 labels=[*base, *labels])
        info.add_metric([*values, *labels.values()], time.time())
        return [info]


class Histogram:
    """Latency observations as Prometheus keeps them: a count per bucket bound, and their sum."""

    def __init__(self, bounds: tuple[float, ...] = _LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts by upper bound, as the text format writes them."""
        cumulative, result = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            cumulative += count
            result.append((bound, cumulative))
        return result


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
            self.metrics.observe("time_to_first_token_seconds", self.first_token - self.arrival)
        self.num_tokens += num_new
        self.metrics.count("generation_tokens", num_new)

    def on_finish(self, finish_reasons: list[str | None]) -> None:
        per_completion = self.num_tokens / self.num_completions  # n > 1: completions decode side by side
        if self.first_token is not None and per_completion > 1:
            tpot = (time.perf_counter() - self.first_token) / (per_completion - 1)
            self.metrics.observe("time_per_output_token_seconds", tpot)
        for reason in finish_reasons:
            self.metrics.count("request_success", 1, str(reason))
