"""Prometheus metrics with vLLM's names under an ``engramrt:`` prefix, plus Engram history slots.
Engine gauges and counters are read at scrape time (as of the engine's last message); latencies
are observed per request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engramrt.engine.client import EngineClient

P = "engramrt:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV blocks in use (1 = full).",
    "engram_history_slots_used": "Engram n-gram history rows held by requests.",
}
_COUNTERS = {
    "num_preemptions": "Requests preempted (recomputed) for lack of KV blocks.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "spec_decode_num_drafts": "Speculative verify runs (a request's drafts of one step).",
    "spec_decode_num_draft_tokens": "Draft tokens proposed.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
}


class _EngineCollector:
    def __init__(self, engine: EngineClient, model: str):
        self.engine, self.model = engine, model

    def collect(self):
        stats = self.engine.stats()
        for name, doc in _GAUGES.items():
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric([self.model], stats[name])
            yield g
        counters = {
            **{k: (v, stats[k]) for k, v in _COUNTERS.items()},
            "prompt_tokens": ("Prompt tokens processed.", stats["prompt_tokens"]),
            "generation_tokens": ("Tokens generated.", stats["generation_tokens"]),
            "triton_compilations": (
                "Triton kernel variants compiled in the engine's process, start-up included "
                "(one after start-up stalls a step).",
                stats["triton_compilations"],
            ),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            c.add_metric([self.model], value)
            yield c
        c = CounterMetricFamily(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Verify runs that accepted their draft at each position (from 0).",
            labels=["model_name", "position"],
        )
        for pos, value in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            c.add_metric([self.model, str(pos)], value)
        yield c


class Metrics:
    def __init__(self, engine: EngineClient, model: str):
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model))
        labels = ["model_name"]

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(P + name, doc, labels, registry=self.registry, buckets=_LATENCY)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last token.")
        self.success = Counter(
            P + "request_success",
            "Finished requests by reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
