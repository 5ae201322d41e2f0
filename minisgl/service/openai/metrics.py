"""Prometheus metrics: request counters and latencies measured in the API server, gauges from the scheduler."""

from __future__ import annotations

import os
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess


class Metrics:
    """Prometheus metrics: request counters and latencies measured here, gauges from the scheduler."""

    LATENCY_BUCKETS = (
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.15,
        0.2,
        0.3,
        0.5,
        0.75,
        1.0,
        2.0,
        5.0,
        10.0,
        30.0,
        60.0,
    )
    STATS: ClassVar[dict[str, tuple[str, str]]] = {  # scheduler stats key -> gauge name, help
        "num_running": ("num_requests_running", "Requests in the running batch"),
        "num_waiting": ("num_requests_waiting", "Requests waiting for admission"),
        "kv_used_pages": ("kv_used_pages", "KV pages in use (by requests or the prefix cache)"),
        "kv_cached_pages": ("kv_cached_pages", "KV pages held by the prefix cache"),
        "kv_total_pages": ("kv_total_pages", "KV pages in the pool"),
        "last_batch_size": ("last_batch_size", "Requests in the latest step"),
        "max_batch_size": ("max_batch_size", "Largest number of requests in one step so far"),
        "num_retractions": ("num_retractions", "Requests retracted when decode ran out of KV"),
        "aborted_requests": ("aborted_requests", "Requests the scheduler aborted"),
        "rejected_requests": ("rejected_requests", "Requests the scheduler rejected"),
        "cache_flushes": ("cache_flushes", "Prefix cache flushes done (/flush_cache)"),
        "integrity_checks": ("integrity_checks", "Idle-time KV integrity checks run"),
        "integrity_failures": ("integrity_failures", "Idle-time KV integrity checks that found a leak"),
        "prompt_tokens": ("scheduler_prompt_tokens", "Prompt tokens admitted by the scheduler"),
        "cached_prompt_tokens": ("cached_prompt_tokens", "Prompt tokens served from the prefix cache"),
        "first_token_seconds_sum": (
            "scheduler_first_token_seconds_sum",
            "Seconds from requests' arrival at the scheduler to their first token, summed",
        ),
        "first_token_count": ("scheduler_first_token_count", "Requests whose first token the scheduler sent"),
        "spec_proposed_tokens": ("spec_proposed_tokens", "Speculative tokens proposed for verification"),
        "spec_accepted_tokens": ("spec_accepted_tokens", "Speculative tokens the target model accepted"),
        "spec_verify_steps": ("spec_verify_steps", "Verify steps run (decode steps with proposals)"),
    }

    # the same numbers under the names gateways scrape: the Kubernetes Gateway API inference extension's
    # endpoint picker reads vLLM's (queue, running, KV usage) or SGLang's (queue, running, token usage);
    # SGLang's router and dashboards read SGLang's. Fractions are 0..1, as both engines export them.
    GATEWAY_NAMES: ClassVar[dict[str, tuple[str, str]]] = {  # gateway name -> derived quantity, help
        "vllm:num_requests_running": ("running", "Requests in the running batch"),
        "vllm:num_requests_waiting": ("waiting", "Requests waiting for admission"),
        "vllm:kv_cache_usage_perc": ("kv_usage", "Fraction of KV pages in use (1 = full)"),
        "vllm:gpu_cache_usage_perc": ("kv_usage", "Fraction of KV pages in use (the older vLLM name)"),
        "vllm:prefix_cache_hit_rate": ("hit_rate", "Fraction of prompt tokens found in the prefix cache"),
        "sglang:num_running_reqs": ("running", "Requests in the running batch"),
        "sglang:num_queue_reqs": ("waiting", "Requests waiting for admission"),
        "sglang:token_usage": ("kv_usage", "Fraction of KV tokens in use (1 = full)"),
        "sglang:cache_hit_rate": ("hit_rate", "Fraction of prompt tokens found in the prefix cache"),
        "sglang:num_used_tokens": ("used_tokens", "KV tokens in use (by requests or the prefix cache)"),
        "sglang:max_total_num_tokens": ("total_tokens", "KV tokens in the pool"),
    }

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self.registry = CollectorRegistry()
        r = self.registry
        # with several API servers (PROMETHEUS_MULTIPROC_DIR, set by the launcher before any import of
        # prometheus_client) each writes its values to files there: counters and histograms are summed,
        # and a gauge, which every server sets from the same scheduler stats, reports the latest value
        self.shared = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        latest = {"multiprocess_mode": "mostrecent"}
        self.requests = Counter("minisgl_requests", "HTTP generation requests", ["endpoint"], registry=r)
        self.errors = Counter(
            "minisgl_request_errors", "Requests refused with HTTP 400", ["code"], registry=r
        )
        self.finished = Counter(
            "minisgl_finished_requests", "Finished choices by reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens of finished choices", registry=r)
        self.generation_tokens = Counter("minisgl_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds",
            "Time to first token",
            buckets=self.LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds",
            "Time between two tokens of a choice",
            buckets=self.LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minisgl_e2e_request_latency_seconds",
            "Request arrival to last token",
            buckets=self.LATENCY_BUCKETS,
            registry=r,
        )
        self.gauges = {
            k: Gauge(f"minisgl_{name}", doc, registry=r, **latest) for k, (name, doc) in self.STATS.items()
        }
        self.kv_usage = Gauge("minisgl_kv_usage_ratio", "Fraction of KV pages in use", registry=r, **latest)
        self.hit_rate = Gauge(
            "minisgl_prefix_cache_hit_rate",
            "Fraction of prompt tokens found in the cache",
            registry=r,
            **latest,
        )
        self.spec_acceptance = Gauge(
            "minisgl_spec_acceptance_rate",
            "Fraction of speculative tokens accepted so far",
            registry=r,
            **latest,
        )
        self.gateway = {
            name: Gauge(name, doc, registry=r, **latest) for name, (_, doc) in self.GATEWAY_NAMES.items()
        }

    def update(self, stats: dict[str, float]) -> None:
        for key, gauge in self.gauges.items():
            if key in stats:
                gauge.set(stats[key])
        if stats.get("kv_total_pages"):
            self.kv_usage.set(stats.get("kv_used_pages", 0) / stats["kv_total_pages"])
        if stats.get("prompt_tokens"):
            self.hit_rate.set(stats.get("cached_prompt_tokens", 0) / stats["prompt_tokens"])
        if stats.get("spec_proposed_tokens"):
            self.spec_acceptance.set(stats.get("spec_accepted_tokens", 0) / stats["spec_proposed_tokens"])
        derived = self._derived(stats)
        for name, (quantity, _) in self.GATEWAY_NAMES.items():
            if quantity in derived:
                self.gateway[name].set(derived[quantity])

    def _derived(self, stats: dict[str, float]) -> dict[str, float]:
        """The quantities the gateway names export, from one stats message (those it has)."""
        out: dict[str, float] = {}
        if "num_running" in stats:
            out["running"] = stats["num_running"]
        if "num_waiting" in stats:
            out["waiting"] = stats["num_waiting"]
        if "kv_used_pages" in stats:
            out["used_tokens"] = stats["kv_used_pages"] * self.page_size
        if stats.get("kv_total_pages"):
            out["total_tokens"] = stats["kv_total_pages"] * self.page_size
            out["kv_usage"] = stats.get("kv_used_pages", 0) / stats["kv_total_pages"]
        if stats.get("prompt_tokens"):
            out["hit_rate"] = stats.get("cached_prompt_tokens", 0) / stats["prompt_tokens"]
        return out

    def render(self) -> bytes:
        if not self.shared:
            return generate_latest(self.registry)
        registry = CollectorRegistry()  # every API server's files, summed
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
