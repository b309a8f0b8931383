"""The server's Prometheus series, with prometheus_client: request histograms and
counters fed with every step's finished outputs, and the engine's own counters and
gauges (scheduler, KV cache, encoder and processor caches) read when /metrics is scraped.

Each server has a registry of its own, so several engines in one process (tests, the UI
beside the API) never share a series.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vlmserve.engine.stats import EngineStats
from vlmserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

PREFIX = "vlmserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80]
_PER_TOKEN = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5]


class EngineMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY, registry=r)
        self.tpot = Histogram(f"{p}time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY, registry=r)
        self.queue = Histogram(f"{p}request_queue_time_seconds", "Arrival to first scheduled.", buckets=_LATENCY,
                               registry=r)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.finished = Counter(f"{p}request_success", "Finished completions by finish reason.",
                                ["finished_reason"], registry=r)
        r.register(_EngineCollector(stats))

    def on_step(self, outputs: list[RequestOutput]) -> None:
        """Counts the finished requests of a step. A request whose numbers cannot be
        counted is logged and skipped: metrics never fail a request or the engine."""
        for out in outputs:
            if out.finished:
                try:
                    self._count(out)
                except Exception:
                    logger.exception("metrics of request %s skipped", out.request_id)

    def _count(self, out: RequestOutput) -> None:
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self.finished.labels(c.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            longest = max((len(c.token_ids) for c in out.outputs), default=0)
            if m.last_token_time is not None and longest > 1:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (longest - 1))
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The engine's numbers, as they are at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        p = PREFIX

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(p + name, help_text, value=value)

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(p + name, help_text, value=value)

        yield gauge("num_requests_running", "Requests being computed.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Share of KV blocks in use (0-1).", s.kv_usage)
        blocks = GaugeMetricFamily(p + "kv_cache_blocks_in_use", "KV blocks held by requests, per attention group.",
                                   labels=["group", "kind"])
        for g, n in s.blocks_in_use.items():
            blocks.add_metric([str(g), s.group_kinds[g]], n)
        yield blocks
        for name, help_text, values in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache, per group.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache, per group.", s.prefix_cache_hits),
        ):
            metric = CounterMetricFamily(p + name, help_text, labels=["group", "kind"])
            for g, value in enumerate(values):
                metric.add_metric([str(g), s.group_kinds[g]], value)
            yield metric
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, all groups.",
                    sum(s.prefix_cache_hits) / max(sum(s.prefix_cache_queries), 1))
        yield gauge("state_slots_in_use", "Recurrent-state slots held by running requests.", s.state_slots_in_use)
        yield gauge("state_snapshots", "Recurrent-state snapshots kept for prefix caching.", s.state_snapshots)
        yield counter("encoder_cache_hits", "Media items served from the encoder cache.", s.encoder_cache_hits)
        yield counter("encoder_cache_misses", "Media items run through the vision encoder.", s.encoder_cache_misses)
        yield gauge("encoder_cache_entries", "Encoder outputs held in the encoder cache.", s.encoder_cache_entries)
        yield gauge("encoder_cache_entries_in_use", "Encoder-cache entries requests still need.",
                    s.encoder_cache_entries_in_use)
        yield gauge("encoder_cache_usage_tokens", "Embedding tokens held in the encoder cache.",
                    s.encoder_cache_tokens)
        yield counter("processor_cache_hits", "Media items whose decoding and resizing was skipped.",
                      s.processor_cache_hits)
        yield counter("processor_cache_misses", "Media items decoded and resized.", s.processor_cache_misses)
        yield counter("num_preemptions", "Requests preempted when KV memory ran out.", s.num_preemptions)
        yield counter("spec_decode_num_drafts", "Steps of a request that checked draft tokens (speculative "
                      "decoding; the mean acceptance length is 1 + accepted tokens over this).", s.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens checked (speculative decoding).",
                      s.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens kept (the acceptance rate is this over "
                      "spec_decode_num_draft_tokens).", s.num_accepted_tokens)
