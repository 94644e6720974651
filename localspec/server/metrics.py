"""Prometheus metrics for the server, in a registry of their own (one per worker), served at /metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Everything /metrics shows. prometheus-client objects are thread-safe: the engine worker
    thread and the event loop both update them."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("localspec_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.request_latency = Histogram("localspec_request_latency_seconds",
                                         "Request latency, from arrival to the last byte (streams included).",
                                         ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("localspec_time_to_first_token_seconds",
                                             "From a generation request's arrival (queueing included) to its first token.",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.generations = Counter("localspec_generations",
                                   "Generations by outcome: completed, time_limit (stopped at the time limit), "
                                   "cancelled (client went away, or shutdown), rejected (invalid prompt), "
                                   "failed (server error).", ["outcome"], registry=r)
        self.prompt_tokens = Counter("localspec_prompt_tokens", "Prompt tokens of completed generations.", registry=r)
        self.prompt_tokens_cached = Counter("localspec_prompt_tokens_cached",
                                            "Prompt tokens reused from the engine's cache (prefix reuse).", registry=r)
        self.tokens_generated = Counter("localspec_tokens_generated",
                                        "Tokens generated (cancelled generations included).", registry=r)
        self.tokens_drafted = Counter("localspec_tokens_drafted", "Draft tokens proposed.", registry=r)
        self.tokens_accepted = Counter("localspec_tokens_accepted", "Draft tokens the oracle accepted.", registry=r)
        self.acceptance_rate = Gauge("localspec_acceptance_rate",
                                     "Draft tokens accepted / drafted since the server started.", registry=r)
        self.queue_depth = Gauge("localspec_queue_depth", "Requests waiting for the engine.", registry=r)
        self.running = Gauge("localspec_generations_running", "Generations in progress (0 or 1).", registry=r)
        self._drafted = 0
        self._accepted = 0

    def record_speculation(self, drafted: int, accepted: int) -> None:
        self.tokens_drafted.inc(drafted)
        self.tokens_accepted.inc(accepted)
        self._drafted += drafted
        self._accepted += accepted
        if self._drafted:
            self.acceptance_rate.set(self._accepted / self._drafted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
