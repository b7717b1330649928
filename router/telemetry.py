"""Prometheus metrics and OpenTelemetry tracing, owned by one ``Telemetry`` object per app.

Metrics live in the app's own ``CollectorRegistry`` (several apps can share a process in tests).
Running/waiting gauges are read from the engines at scrape time, so they can never drift.

Tracing follows the standard ``OTEL_*`` variables: with neither ``OTEL_EXPORTER_OTLP_ENDPOINT``
nor ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set (or ``OTEL_SDK_DISABLED=true``) it is off and costs
nothing. ``OTEL_EXPORTER_OTLP_PROTOCOL`` picks ``http/protobuf`` (default) or ``grpc``; the
sampler comes from ``OTEL_TRACES_SAMPLER``/``_ARG``; the service name from ``OTEL_SERVICE_NAME``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tiers.core.sequence import Sequence

__all__ = ["Telemetry"]

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

# monotonic -> epoch nanoseconds, for spans built from engine timestamps after the fact.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def mono_to_ns(t: float) -> int:
    return int(t * 1e9) + _EPOCH_OFFSET_NS


class _EngineLoadCollector(Collector):
    def __init__(self, loads: Callable[[], Mapping[str, Any]]) -> None:
        self._loads = loads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running = GaugeMetricFamily(
            "router_running_requests", "Sequences in the running batch", labels=["tier"]
        )
        waiting = GaugeMetricFamily("router_waiting_requests", "Requests waiting for a slot", labels=["tier"])
        kv = GaugeMetricFamily("router_kv_cache_usage_ratio", "KV tokens in use / capacity", labels=["tier"])
        for tier, load in self._loads().items():
            running.add_metric([tier], getattr(load, "num_running", getattr(load, "in_flight", 0)))
            waiting.add_metric([tier], getattr(load, "num_waiting", 0))
            cap = getattr(load, "kv_capacity", 0)
            kv.add_metric([tier], (load.kv_tokens / cap) if cap else 0.0)
        yield running
        yield waiting
        yield kv


class Telemetry:
    def __init__(self, service_name: str = "tiered-router", record_content: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.record_content = record_content
        r = self.registry
        self.requests = Counter(
            "router_requests",
            "Requests by tier, rule, outcome and tenant (tenants named in the policy; others are "
            "'other', unauthenticated or tenant-less callers '-': the label set stays bounded)",
            ["endpoint", "tier", "rule", "outcome", "tenant"],
            registry=r,
        )
        self.e2e = Histogram(
            "router_request_duration_seconds",
            "End-to-end latency",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "router_time_to_first_token_seconds",
            "Time to first token",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "router_inter_token_latency_seconds",
            "Mean inter-token latency per request",
            ["tier"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "router_queue_time_seconds",
            "Wait for a batch slot",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("router_prompt_tokens", "Prompt tokens", ["tier"], registry=r)
        self.completion_tokens = Counter("router_completion_tokens", "Generated tokens", ["tier"], registry=r)
        self.cached_tokens = Counter(
            "router_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix KV cache",
            ["tier"],
            registry=r,
        )
        self.spec_draft = Counter(
            "router_spec_decode_draft_tokens", "Speculative tokens drafted", ["tier"], registry=r
        )
        self.spec_accepted = Counter(
            "router_spec_decode_accepted_tokens", "Speculative tokens accepted", ["tier"], registry=r
        )
        self.spec_steps = Counter(
            "router_spec_decode_steps", "Speculative decode steps", ["tier"], registry=r
        )
        self.engine_steps = Counter("router_engine_steps", "Engine steps", ["tier", "kind"], registry=r)
        self.engine_step_time = Histogram(
            "router_engine_step_seconds",
            "Engine step time",
            ["tier", "kind"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.classifier_latency = Histogram(
            "router_classifier_latency_seconds",
            "Complexity scoring latency",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.route_decisions = Counter(
            "router_route_decisions", "Routing decisions", ["tier", "rule"], registry=r
        )
        self.cache_hits = Counter("router_cache_hits", "Response cache hits", ["kind"], registry=r)
        self.cache_misses = Counter("router_cache_misses", "Response cache misses", registry=r)
        self.cache_errors = Counter(
            "router_cache_errors",
            "Response cache store failures (Redis down, stalled or corrupt): served as misses",
            ["op"],
            registry=r,
        )
        self.stored_responses_evicted = Counter(
            "router_stored_responses_evicted",
            "Stored responses (Responses API) dropped before their TTL: partition_quota (their "
            "partition passed its byte quota), capacity (the store's count or byte bound)",
            ["reason"],
            registry=r,
        )
        self.policy_reloads = Counter("router_policy_reloads", "Policy reloads applied", registry=r)
        self.policy_reload_failures = Counter(
            "router_policy_reload_failures", "Policy reloads rejected", registry=r
        )
        self.ready = Gauge("router_ready", "1 when every tier is loaded and warmed up", registry=r)
        self._tracer_provider, self.tracer = _make_tracer(service_name)
        self._propagator = TraceContextTextMapPropagator()

    def count_request(self, endpoint: str, tier: str, rule: str, outcome: str, tenant: str = "-") -> None:
        self.requests.labels(endpoint, tier, rule, outcome, tenant).inc()

    def watch_engines(self, loads: Callable[[], Mapping[str, Any]]) -> None:
        self.registry.register(_EngineLoadCollector(loads))

    # -- engine observer ---------------------------------------------------------------------------
    def on_step(self, tier: str, kind: str, num_seqs: int, seconds: float) -> None:
        self.engine_steps.labels(tier, kind).inc()
        self.engine_step_time.labels(tier, kind).observe(seconds)

    def on_spec(self, tier: str, drafted: int, accepted: int) -> None:
        self.spec_steps.labels(tier).inc()
        self.spec_draft.labels(tier).inc(drafted)
        self.spec_accepted.labels(tier).inc(accepted)

    def on_finish(self, tier: str, seq: Sequence) -> None:
        pass  # per-request figures are recorded by the service, which also sees remote tiers

    # -- per request -------------------------------------------------------------------------------
    def record_generation(
        self, tier: str, timings: Mapping[str, float], prompt: int, completion: int, cached: int
    ) -> None:
        self.prompt_tokens.labels(tier).inc(prompt)
        self.completion_tokens.labels(tier).inc(completion)
        if cached:
            self.cached_tokens.labels(tier).inc(cached)
        arrival = timings.get("arrival")
        if arrival is None:
            return
        if "scheduled" in timings:
            self.queue.labels(tier).observe(timings["scheduled"] - arrival)
        if "first_token" in timings:
            self.ttft.labels(tier).observe(timings["first_token"] - arrival)
            if "finish" in timings and completion > 1:
                self.itl.labels(tier).observe((timings["finish"] - timings["first_token"]) / (completion - 1))

    # -- tracing -----------------------------------------------------------------------------------
    @property
    def tracing_enabled(self) -> bool:
        return self._tracer_provider is not None

    @contextmanager
    def span(
        self, name: str, *, parent: Span | None = None, attributes: Mapping[str, Any] | None = None
    ) -> Iterator[Span]:
        """A child span of ``parent`` (explicit: streamed responses outlive the handler's context)."""
        if not self.tracing_enabled or parent is None:
            yield NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)
            return
        span = self.tracer.start_span(name, context=trace.set_span_in_context(parent), attributes=attributes)
        try:
            yield span
        except BaseException as exc:
            self.mark_error(span, exc)
            raise
        finally:
            span.end()

    def server_span(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]
    ) -> Span | None:
        """The request's root span, continuing the caller's W3C ``traceparent`` when present."""
        if not self.tracing_enabled:
            return None
        ctx = self._propagator.extract(carrier=dict(headers))
        return self.tracer.start_span(name, context=ctx, kind=SpanKind.SERVER, attributes=attributes)

    def phase_spans(
        self, timings: Mapping[str, float], attributes: Mapping[str, Any], parent: Span | None
    ) -> None:
        """queue / prefill / decode as child spans of ``parent``, from engine timestamps."""
        if not self.tracing_enabled or parent is None or "arrival" not in timings:
            return
        parent_ctx = trace.set_span_in_context(parent)
        bounds = [
            ("queue", timings.get("arrival"), timings.get("scheduled")),
            ("prefill", timings.get("scheduled"), timings.get("first_token")),
            ("decode", timings.get("first_token"), timings.get("finish")),
        ]
        for name, start, end in bounds:
            if start is None or end is None:
                continue
            span = self.tracer.start_span(
                name,
                context=parent_ctx,
                start_time=mono_to_ns(start),
                attributes=attributes if name == "decode" else None,
            )
            span.end(end_time=mono_to_ns(end))

    def mark_error(self, span: Span, exc: BaseException) -> None:
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        span.record_exception(exc)

    def shutdown(self) -> None:
        if self._tracer_provider is not None:
            try:
                self._tracer_provider.force_flush(5000)
                self._tracer_provider.shutdown()
            except Exception:  # never fail a shutdown on telemetry
                log.exception("telemetry shutdown failed")


def _make_tracer(service_name: str) -> tuple[Any, trace.Tracer]:
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true"
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if disabled or not endpoint:
        return None, trace.NoOpTracer()
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    exporter: Any
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter()
    # Resource.create() merges OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES over our default name.
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    return provider, provider.get_tracer("tiered-router")
