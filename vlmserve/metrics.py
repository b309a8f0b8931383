"""The server's Prometheus series, with prometheus_client: request histograms and
counters fed with every step's finished outputs, and the engine's own counters and
gauges read when /metrics is scraped.

What vLLM also reports goes under vLLM's names, labels (`model_name`, `engine`) and
histogram buckets, so a vLLM Grafana dashboard and its alerts work unchanged
(`names="vlmserve"` keeps the names vlmserve used before: the `vlmserve:` prefix, no
labels). What only vlmserve has — KV blocks and prefix-cache counts per cache group,
recurrent-state slots and snapshots, the encoder and processor caches — is always
`vlmserve:`.

Each server has a registry of its own, so several engines in one process (tests, the UI
beside the API) never share a series.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vlmserve.core.sched_output import SchedulerStats
from vlmserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class EngineStats(SchedulerStats):
    """What the engine reports about itself: the scheduler's numbers and the processor cache's."""

    processor_cache_hits: int = 0
    processor_cache_misses: int = 0

    @classmethod
    def of(cls, scheduler: SchedulerStats, processor_cache_hits: int, processor_cache_misses: int) -> EngineStats:
        return cls(**asdict(scheduler), processor_cache_hits=processor_cache_hits,
                   processor_cache_misses=processor_cache_misses)


PREFIX = "vlmserve:"  # vlmserve's own series
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NAMES = ("vllm", "vlmserve")  # whose names the series vLLM also has go under
# vLLM's buckets (vllm/v1/metrics/loggers.py)
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
         160.0, 640.0, 2560.0]
_PER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0]


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context (vLLM's request-size buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class EngineMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str, max_model_len: int,
                 names: str = "vllm") -> None:
        if names not in NAMES:
            raise ValueError(f"metrics names: one of {NAMES}, got {names!r}")
        self.registry = r = CollectorRegistry()
        vllm = names == "vllm"
        p = "vllm:" if vllm else PREFIX
        labels = ["model_name", "engine"] if vllm else []
        self._labels = (model_name, "0") if vllm else ()

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(p + name, doc, labels, buckets=buckets, registry=r)

        def counter(name: str, doc: str, extra: list[str] = ()) -> Counter:
            return Counter(p + name, doc, labels + list(extra), registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT)
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token after the first, per request "
                              "(vLLM's older name).", _PER_TOKEN)
        self.request_tpot = histogram("request_time_per_output_token_seconds", "Time per output token after the "
                                      "first, per request.", _PER_TOKEN)
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens (a request's mean "
                             "interval, once per interval).", _PER_TOKEN)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST)
        self.prompt_sizes = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                      _token_buckets(max_model_len))
        self.generation_sizes = histogram("request_generation_tokens", "Generated tokens per request.",
                                          _token_buckets(max_model_len))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.finished = counter("request_success", "Finished completions by finish reason.", ["finished_reason"])
        r.register(_EngineCollector(stats, p, labels, self._labels))

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
        generated = sum(len(c.token_ids) for c in out.outputs)
        self._child(self.prompt_tokens).inc(len(out.prompt_token_ids))
        self._child(self.generation_tokens).inc(generated)
        self._child(self.prompt_sizes).observe(len(out.prompt_token_ids))
        self._child(self.generation_sizes).observe(generated)
        for c in out.outputs:
            self.finished.labels(*self._labels, c.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self._child(self.queue).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self._child(self.ttft).observe(m.first_token_time - m.arrival_time)
            longest = max((len(c.token_ids) for c in out.outputs), default=0)
            if m.last_token_time is not None and longest > 1:
                per_token = (m.last_token_time - m.first_token_time) / (longest - 1)
                self._child(self.tpot).observe(per_token)
                self._child(self.request_tpot).observe(per_token)
                for _ in range(longest - 1):
                    self._child(self.itl).observe(per_token)
        if m.finished_time is not None:
            self._child(self.e2e).observe(m.finished_time - m.arrival_time)

    def _child(self, metric):
        """The series of this engine (with vLLM's labels, where they are used)."""
        return metric.labels(*self._labels) if self._labels else metric

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The engine's numbers, as they are at scrape time: the series vLLM also has under
    `prefix` with its labels, vlmserve's own under `vlmserve:`."""

    def __init__(self, stats: Callable[[], EngineStats], prefix: str, labels: list[str], values: tuple) -> None:
        self.stats = stats
        self.prefix, self.labels, self.values = prefix, labels, list(values)

    def _shared(self, kind, name: str, doc: str, value: float):
        metric = kind(self.prefix + name, doc, labels=self.labels)
        metric.add_metric(self.values, value)
        return metric

    def _connector(self, s: EngineStats):
        """A KV connector's (a host tier, a shared pool): vLLM's external prefix cache, and its copies."""
        yield self._shared(CounterMetricFamily, "external_prefix_cache_queries", "Prompt tokens looked up in the KV "
                           "connector (--kv-offloading-size, --kv-transfer-config).", s.connector_queries)
        yield self._shared(CounterMetricFamily, "external_prefix_cache_hits", "Prompt tokens the KV connector "
                           "supplied, past the device's prefix-cache hits.", s.connector_hits)
        moved = CounterMetricFamily(PREFIX + "kv_connector_bytes", "KV bytes copied to the KV connector's store "
                                    "(save) and back (load), a rank's.", labels=["direction"])
        moved.add_metric(["save"], s.connector_blocks_saved * s.connector_block_bytes)
        moved.add_metric(["load"], s.connector_blocks_loaded * s.connector_block_bytes)
        yield moved
        seconds = CounterMetricFamily(PREFIX + "kv_connector_seconds", "Seconds spent copying KV to the connector's "
                                      "store (save) and back (load: a pool's fetches included).", labels=["direction"])
        seconds.add_metric(["save"], s.connector_save_seconds)
        seconds.add_metric(["load"], s.connector_load_seconds)
        yield seconds
        yield GaugeMetricFamily(PREFIX + "kv_connector_blocks_held", "KV blocks the connector holds (a host tier's; "
                                "a shared pool's are not counted here).", value=s.connector_blocks_held)

    def collect(self):
        s = self.stats()
        p = PREFIX
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._shared(gauge, "num_requests_running", "Requests being computed.", s.num_running)
        yield self._shared(gauge, "num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._shared(gauge, "kv_cache_usage_perc", "Share of KV blocks in use (0-1).", s.kv_usage)
        yield self._shared(counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (all cache "
                           "groups).", sum(s.prefix_cache_queries))
        yield self._shared(counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache (all cache groups).",
                           sum(s.prefix_cache_hits))
        yield self._shared(counter, "num_preemptions", "Requests preempted when KV memory ran out.", s.num_preemptions)
        yield self._shared(counter, "spec_decode_num_drafts", "Steps of a request that checked draft tokens "
                           "(speculative decoding; the mean acceptance length is 1 + accepted tokens over this).",
                           s.num_drafts)
        yield self._shared(counter, "spec_decode_num_draft_tokens", "Draft tokens checked (speculative decoding).",
                           s.num_draft_tokens)
        yield self._shared(counter, "spec_decode_num_accepted_tokens", "Draft tokens kept (the acceptance rate is "
                           "this over spec_decode_num_draft_tokens).", s.num_accepted_tokens)
        per_position = CounterMetricFamily(self.prefix + "spec_decode_num_accepted_tokens_per_pos", "Checks that kept "
                                           "the draft at each position (its acceptance rate is this over "
                                           "spec_decode_num_drafts).", labels=[*self.labels, "position"])
        for i, n in enumerate(s.num_accepted_per_position):
            per_position.add_metric([*self.values, str(i)], n)
        yield per_position
        yield from self._connector(s)
        # vlmserve's own
        blocks = gauge(p + "kv_cache_blocks_in_use", "KV blocks held by requests, per attention group.",
                       labels=["group", "kind"])
        for g, n in s.blocks_in_use.items():
            blocks.add_metric([str(g), s.group_kinds[g]], n)
        yield blocks
        for name, help_text, values in (
            ("prefix_cache_group_queries", "Prompt tokens looked up in the prefix cache, per group.",
             s.prefix_cache_queries),
            ("prefix_cache_group_hits", "Prompt tokens found in the prefix cache, per group.", s.prefix_cache_hits),
        ):
            metric = counter(p + name, help_text, labels=["group", "kind"])
            for g, value in enumerate(values):
                metric.add_metric([str(g), s.group_kinds[g]], value)
            yield metric
        yield gauge(p + "prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, all groups.",
                    value=sum(s.prefix_cache_hits) / max(sum(s.prefix_cache_queries), 1))
        yield gauge(p + "state_slots_in_use", "Recurrent-state slots held by running requests.",
                    value=s.state_slots_in_use)
        yield gauge(p + "state_snapshots", "Recurrent-state snapshots kept for prefix caching.", value=s.state_snapshots)
        yield counter(p + "encoder_cache_hits", "Media items served from the encoder cache.",
                      value=s.encoder_cache_hits)
        yield counter(p + "encoder_cache_misses", "Media items run through the vision encoder.",
                      value=s.encoder_cache_misses)
        yield gauge(p + "encoder_cache_entries", "Encoder outputs held in the encoder cache.",
                    value=s.encoder_cache_entries)
        yield gauge(p + "encoder_cache_entries_in_use", "Encoder-cache entries requests still need.",
                    value=s.encoder_cache_entries_in_use)
        yield gauge(p + "encoder_cache_usage_tokens", "Embedding tokens held in the encoder cache.",
                    value=s.encoder_cache_tokens)
        yield counter(p + "processor_cache_hits", "Media items whose decoding and resizing was skipped.",
                      value=s.processor_cache_hits)
        yield counter(p + "processor_cache_misses", "Media items decoded and resized.", value=s.processor_cache_misses)
