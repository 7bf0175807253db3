"""Prometheus metrics of one app (its own CollectorRegistry, so several apps can live in one
process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# an expert's load relative to a balanced one (its layer's tokens spread evenly over its experts)
_RELATIVE_LOAD_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.1, 1.5, 2.0, 4.0, 8.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "compiled_engine_"
        self.requests = Counter(
            p + "requests",
            "HTTP generation requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(p + "generation_tokens", "generated tokens", registry=r)
        self.in_flight = Gauge(
            p + "server_in_flight_sequences", "sequences the server is waiting on", registry=r
        )
        self.waiting = Gauge(
            p + "num_requests_waiting", "requests queued in the scheduler", registry=r
        )
        self.running = Gauge(
            p + "num_requests_running", "requests running in the scheduler", registry=r
        )
        self.kv_usage = Gauge(p + "kv_cache_usage", "fraction of KV pages in use", registry=r)
        self.cache_hit_rate = Gauge(
            p + "prefix_cache_hit_rate", "prefix tokens reused / prompt tokens", registry=r
        )
        self.retractions = Gauge(p + "num_retractions", "requests retracted so far", registry=r)
        self.weight_bytes = Gauge(
            p + "weight_bytes",
            "bytes of the model's weights in rank 0 (packed GGUF / --quantization weights as "
            "packed)",
            registry=r,
        )
        # speculative decoding, under vLLM's names (their totals come from the engine: `_spec_seen`
        # holds the last totals so that each scrape adds the difference)
        self.spec = {
            field: Counter(f"vllm:spec_decode_{name}", help_, registry=r)
            for field, name, help_ in (
                ("spec_num_drafts", "num_drafts", "verify steps (a request's step with drafts)"),
                ("spec_num_draft_tokens", "num_draft_tokens", "draft tokens proposed"),
                ("spec_num_accepted_tokens", "num_accepted_tokens", "draft tokens accepted"),
            )
        }
        self._spec_seen = dict.fromkeys(self.spec, 0)
        # the same as above, under the names routers and autoscalers scrape (vLLM's); prefix-cache
        # tokens as vLLM counts them: looked up and hit at admission
        self.vllm_running = Gauge("vllm:num_requests_running", "requests running", registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "requests waiting", registry=r)
        # the older name and the newer one, as vLLM's releases differ
        self.vllm_kv_usage = [
            Gauge(name, "KV cache usage, 1 = full (whatever the device)", registry=r)
            for name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")
        ]
        self.prefix = {
            field: Counter(f"vllm:{name}", help_, registry=r)
            for field, name, help_ in (
                ("prefix_cache_queries", "prefix_cache_queries",
                 "prompt tokens looked up in the prefix cache"),
                ("prefix_cache_hits", "prefix_cache_hits",
                 "prompt tokens found in the prefix cache"),
                # vLLM's name for hits outside its pool (a KV connector's): here the KV tier's
                ("tier_hit_tokens", "external_prefix_cache_hits",
                 "prompt tokens loaded from the KV tier (disk)"),
            )
        }
        self._prefix_seen = dict.fromkeys(self.prefix, 0)
        self.kv_pool_bytes = Gauge(p + "kv_pool_bytes", "bytes of rank 0's KV pool", registry=r)
        # mixture of experts: the load of each expert of each routed layer (imbalance shows as
        # unequal rates across one layer's experts)
        self.expert_tokens = Counter(p + "moe_expert_tokens", "tokens computed by each expert",
                                     ["layer", "expert"], registry=r)
        self.expert_load = Histogram(
            p + "moe_expert_relative_load",
            "each expert's tokens over its layer's mean per expert, per stats poll (1: balanced, "
            "0: idle)", ["layer"], registry=r, buckets=_RELATIVE_LOAD_BUCKETS)
        self._expert_seen: dict[tuple[int, int], int] = {}
        self.ttft = Histogram(p + "time_to_first_token_seconds", "time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram(
            p + "time_per_output_token_seconds",
            "time per output token after the first",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "end-to-end sequence latency",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )

    def observe_finished(self, start: float, first_token_at: float | None, num_tokens: int) -> None:
        now = time.monotonic()
        self.generation_tokens.inc(num_tokens)
        self.e2e.observe(now - start)
        if first_token_at is not None:
            self.ttft.observe(first_token_at - start)
            if num_tokens > 1:
                self.tpot.observe((now - first_token_at) / (num_tokens - 1))

    def set_engine_stats(self, stats: dict, in_flight: int) -> None:
        self.in_flight.set(in_flight)
        self.waiting.set(stats["num_waiting"])
        self.running.set(stats["num_running"])
        self.kv_usage.set(stats["kv_usage"])
        self.cache_hit_rate.set(stats["cache_hit_rate"])
        self.retractions.set(stats["num_retractions"])
        self.vllm_running.set(stats["num_running"])
        self.vllm_waiting.set(stats["num_waiting"])
        for gauge in self.vllm_kv_usage:
            gauge.set(stats["kv_usage"])
        _add_new(self.spec, self._spec_seen, stats)
        _add_new(self.prefix, self._prefix_seen, stats)
        for layer, counts in stats.get("expert_tokens", {}).items():
            self._add_expert_load(layer, counts)

    def _add_expert_load(self, layer: int, counts: list[int]) -> None:
        """One layer's expert totals: each counter grows by its expert's new tokens, and when the
        layer computed any since the last poll, each expert's share of them (times the number of
        experts) goes into the histogram. Totals below the last ones were counted from zero again
        (the engine resets them): all of them are new."""
        seen = [self._expert_seen.get((layer, e), 0) for e in range(len(counts))]
        if any(total < last for total, last in zip(counts, seen, strict=True)):
            seen = [0] * len(counts)
        grown = [total - last for total, last in zip(counts, seen, strict=True)]
        for expert, (total, n) in enumerate(zip(counts, grown, strict=True)):
            self._expert_seen[layer, expert] = total
            if n > 0:
                self.expert_tokens.labels(str(layer), str(expert)).inc(n)
        if sum(grown) > 0:
            for n in grown:
                self.expert_load.labels(str(layer)).observe(n * len(counts) / sum(grown))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _add_new(counters: dict[str, Counter], seen: dict[str, int], stats: dict) -> None:
    """Counters fed from the engine's totals: each adds what its total grew by since last time."""
    for field, counter in counters.items():
        total = stats.get(field, 0)
        if total > seen[field]:
            counter.inc(total - seen[field])
            seen[field] = total
