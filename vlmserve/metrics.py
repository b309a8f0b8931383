"""Engine metrics in the Prometheus text format (no client library needed for this much)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from vlmserve.core.scheduler import SchedulerStats
from vlmserve.outputs import RequestOutput

PREFIX = "vlmserve:"


@dataclass
class Histogram:
    buckets: list[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, count in zip(self.buckets, self.counts):
            lines.append(f'{name}_bucket{{le="{bound}"}} {count}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total}", f"{name}_count {self.n}"]
        return lines


_LATENCY = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80]
_PER_TOKEN = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5]


class EngineMetrics:
    """Request-level histograms and counters, fed with every step's outputs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft = Histogram(_LATENCY)
        self.tpot = Histogram(_PER_TOKEN)
        self.e2e = Histogram(_LATENCY)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}

    def on_step(self, outputs: list[RequestOutput]) -> None:
        with self.lock:
            for out in outputs:
                if not out.finished:
                    continue
                m = out.metrics
                generated = sum(len(c.token_ids) for c in out.outputs)
                self.prompt_tokens += len(out.prompt_token_ids)
                self.generation_tokens += generated
                for c in out.outputs:
                    self.finished[c.finish_reason or "unknown"] = self.finished.get(c.finish_reason or "unknown", 0) + 1
                if m is None:
                    continue
                if m.first_token_time is not None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                    if m.last_token_time is not None and generated > 1:
                        per = (m.last_token_time - m.first_token_time) / (max(len(c.token_ids) for c in out.outputs) - 1)
                        self.tpot.observe(per)
                if m.finished_time is not None:
                    self.e2e.observe(m.finished_time - m.arrival_time)

    def render(self, stats: SchedulerStats, group_kinds: list[str], processor_hits: int, processor_misses: int) -> str:
        p = PREFIX
        lines: list[str] = []

        def gauge(name, help_text, value, labels=""):
            lines.extend([f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} gauge", f"{p}{name}{labels} {value}"])

        def counter(name, help_text, samples):
            lines.extend([f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} counter"])
            lines.extend(f"{p}{name}{labels} {value}" for labels, value in samples)

        gauge("num_requests_running", "Requests being computed.", stats.num_running)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        gauge("kv_cache_usage_perc", "Share of KV blocks in use (0-1).", round(stats.kv_usage, 6))
        lines += [f"# HELP {p}kv_cache_blocks_in_use KV blocks (attention) or state slots (recurrent) held by requests, per KV cache group.",
                  f"# TYPE {p}kv_cache_blocks_in_use gauge"]
        for g, (n, kind) in enumerate(zip(stats.blocks_in_use, group_kinds)):
            lines.append(f'{p}kv_cache_blocks_in_use{{group="{g}",kind="{kind}"}} {n}')
        groups = list(enumerate(group_kinds))
        counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache, per group.",
                [(f'{{group="{g}",kind="{k}"}}', stats.prefix_cache_queries[g]) for g, k in groups])
        counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache, per group.",
                [(f'{{group="{g}",kind="{k}"}}', stats.prefix_cache_hits[g]) for g, k in groups])
        queries = sum(stats.prefix_cache_queries) or 1
        gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, all groups.",
              round(sum(stats.prefix_cache_hits) / queries, 6))
        counter("encoder_cache_hits_total", "Media items served from the encoder cache.", [("", stats.encoder_cache_hits)])
        counter("encoder_cache_misses_total", "Media items run through the vision encoder.", [("", stats.encoder_cache_misses)])
        counter("processor_cache_hits_total", "Media items whose decoding and resizing was skipped.", [("", processor_hits)])
        counter("processor_cache_misses_total", "Media items decoded and resized.", [("", processor_misses)])
        counter("num_preemptions_total", "Requests preempted when KV memory ran out.", [("", stats.num_preemptions)])
        with self.lock:
            counter("prompt_tokens_total", "Prompt tokens of finished requests.", [("", self.prompt_tokens)])
            counter("generation_tokens_total", "Generated tokens of finished requests.", [("", self.generation_tokens)])
            counter("request_success_total", "Finished completions by finish reason.",
                    [(f'{{finished_reason="{r}"}}', n) for r, n in sorted(self.finished.items())])
            lines += self.ttft.render(f"{p}time_to_first_token_seconds", "Time to first token.")
            lines += self.tpot.render(f"{p}time_per_output_token_seconds", "Time per output token after the first.")
            lines += self.e2e.render(f"{p}e2e_request_latency_seconds", "Arrival to finish.")
        return "\n".join(lines) + "\n"
