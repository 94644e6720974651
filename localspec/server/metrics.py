"""Prometheus metrics for the server, in a registry of their own (one per worker), served at /metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PASS_SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PASS_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MAX_POSITION_LABEL = 63  # accepted tokens per position are counted for the first 64 places


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
        self.queue_depth = Gauge("localspec_queue_depth", "Requests waiting for a slot.", registry=r)
        self.running = Gauge("localspec_generations_running", "Generations in progress (each in a slot).", registry=r)
        self.slots = Gauge("localspec_slots", "Sequences the engine generates at once (serve --parallel).", registry=r)
        self.slots_busy = Gauge("localspec_slots_busy", "Slots holding a request.", registry=r)
        self.pass_sequences = Histogram("localspec_pass_sequences", "Sequences one oracle pass carried.",
                                        buckets=PASS_SEQUENCE_BUCKETS, registry=r)
        self.pass_tokens = Histogram("localspec_pass_tokens", "Tokens one oracle pass carried (drafts and prompt "
                                     "chunks included).", buckets=PASS_TOKEN_BUCKETS, registry=r)
        # speculation in vLLM's shape: mean acceptance length = 1 + accepted_tokens / drafts
        self.spec_drafts = Counter("localspec_spec_decode_num_drafts", "Steps that verified a draft.", registry=r)
        self.spec_draft_tokens = Counter("localspec_spec_decode_num_draft_tokens", "Draft tokens verified.",
                                         registry=r)
        self.spec_accepted_tokens = Counter("localspec_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("localspec_spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their place in the draft (0: the first).",
                                             ["position"], registry=r)
        self.spec_draft_tokens_by_source = Counter(
            "localspec_spec_decode_num_draft_tokens_by_source", "Draft tokens verified, by where the draft came "
            "from: model (the draft model), lookup (prompt lookup), suffix (the suffix cache).", ["source"], registry=r)
        self.spec_accepted_tokens_by_source = Counter(
            "localspec_spec_decode_num_accepted_tokens_by_source", "Draft tokens accepted, by where the draft came "
            "from.", ["source"], registry=r)
        self.host_seconds = Counter("localspec_host_seconds", "Seconds the steps of completed generations spent "
                                    "outside llama.cpp (wall time minus time in its decodes), by phase: draft "
                                    "(proposing), verify (batch, acceptance, rollback), other (emitting).",
                                    ["phase"], registry=r)
        self._drafted = 0
        self._accepted = 0

    def record_step(self, step) -> None:
        """One speculative step of one sequence (an `outputs.StepRecord`)."""
        if not step.drafted:
            return
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(step.drafted)
        self.spec_accepted_tokens.inc(step.accepted)
        source = str(step.source)
        self.spec_draft_tokens_by_source.labels(source).inc(step.drafted)
        self.spec_accepted_tokens_by_source.labels(source).inc(step.accepted)
        for position in range(min(step.accepted, MAX_POSITION_LABEL + 1)):
            self.spec_accepted_per_pos.labels(str(position)).inc()

    def record_host_time(self, stats) -> None:
        """A completed generation's host time (an `outputs.Stats`), by phase."""
        for phase, seconds in (("draft", stats.host_draft_time), ("verify", stats.host_verify_time),
                               ("other", stats.host_other_time)):
            self.host_seconds.labels(phase).inc(max(0.0, seconds))

    def record_speculation(self, drafted: int, accepted: int) -> None:
        self.tokens_drafted.inc(drafted)
        self.tokens_accepted.inc(accepted)
        self._drafted += drafted
        self._accepted += accepted
        if self._drafted:
            self.acceptance_rate.set(self._accepted / self._drafted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
