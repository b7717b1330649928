"""Traces to a real OTLP/HTTP receiver on loopback (protobuf decoded with opentelemetry-proto) and
Prometheus metrics parsed with prometheus_client's own parser."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, start_server


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.resources: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                    receiver.resources.append(attrs)
                    for ss in rs.scope_spans:
                        receiver.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.1)
        raise AssertionError(f"spans: {[s.name for s in self.spans]}")


def attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = (
            v.string_value or v.int_value or v.double_value or v.bool_value or list(v.array_value.values)
        )
    return out


@pytest.fixture(scope="module")
def traced(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Receiver]]:
    receiver = Receiver()
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{receiver.port}"
    os.environ["OTEL_SERVICE_NAME"] = "router-under-test"
    try:
        path = tmp_path_factory.mktemp("otel") / "policy.yaml"
        path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=True))
        srv, stop = start_server(path, watch_policy=False)
    finally:
        os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        os.environ.pop("OTEL_SERVICE_NAME", None)
    yield srv, receiver
    stop()
    receiver.server.shutdown()


def test_span_tree_and_genai_attributes(traced: tuple[Server, Receiver]) -> None:
    srv, rx = traced
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={
            "model": "auto",
            "messages": [{"role": "user", "content": "trace me"}],
            "max_tokens": 5,
            "temperature": 0,
        },
    )
    assert r.status_code == 200
    rx.wait(lambda: any(s.name == "decode" for s in rx.spans))
    root = next(s for s in rx.spans if s.name == "POST /v1/chat/completions")
    children = {
        s.name: s for s in rx.spans if s.trace_id == root.trace_id and s.parent_span_id == root.span_id
    }
    assert {"cache.lookup", "classify", "policy.decide", "queue", "prefill", "decode"} <= set(children)
    a = attrs(root)
    assert a["gen_ai.request.model"] == "auto"
    assert a["gen_ai.response.model"] == r.headers["x-router-tier"] == a["router.tier"]
    assert a["router.rule"] == r.headers["x-router-rule"]
    assert abs(a["router.score"] - float(r.headers["x-router-score"])) < 1e-3
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
    assert a["gen_ai.request.temperature"] == 0 or "gen_ai.request.temperature" in a
    assert a["http.response.status_code"] == 200
    assert "gen_ai.prompt" not in a and "gen_ai.completion" not in a  # content is opt-in
    assert attrs(children["decode"])["gen_ai.usage.output_tokens"] == a["gen_ai.usage.output_tokens"]
    assert any(res.get("service.name") == "router-under-test" for res in rx.resources)
    q, p, d = children["queue"], children["prefill"], children["decode"]
    assert q.start_time_unix_nano <= p.start_time_unix_nano <= d.start_time_unix_nano <= d.end_time_unix_nano


def test_traceparent_is_honoured(traced: tuple[Server, Receiver]) -> None:
    srv, rx = traced
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = "00f067aa0ba902b7"
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        json={"model": "small", "messages": [{"role": "user", "content": "propagate"}], "max_tokens": 3},
    )
    assert r.status_code == 200
    rx.wait(lambda: any(s.trace_id.hex() == trace_id for s in rx.spans))
    root = next(s for s in rx.spans if s.trace_id.hex() == trace_id and s.name.startswith("POST"))
    assert root.parent_span_id.hex() == parent


def test_errors_mark_the_span(traced: tuple[Server, Receiver]) -> None:
    srv, rx = traced
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 404
    rx.wait(lambda: any(attrs(s).get("http.response.status_code") == 404 for s in rx.spans))


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""
            )
            out[key] = s.value
    return out


def total(m: dict[str, float], name: str, **labels: str) -> float:
    want = [f"{k}={v}" for k, v in labels.items()]
    return sum(v for k, v in m.items() if k.split("{")[0] == name and all(w in k for w in want))


def test_metrics_families_move(traced: tuple[Server, Receiver]) -> None:
    srv, _ = traced
    srv.engine("large").spec.fixed_k = 2  # make sure speculative steps happen on this tiny model
    before = scrape(srv.url)
    body = {
        "model": "large",
        "messages": [{"role": "user", "content": "metrics please"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 200
    assert httpx.post(srv.url + "/v1/chat/completions", json=body).headers["x-router-cache"] in (
        "miss",
        "hit",
    )
    after = scrape(srv.url)
    srv.engine("large").spec.fixed_k = None
    for name, labels in [
        ("router_requests_total", {"tier": "large", "outcome": "ok"}),
        ("router_time_to_first_token_seconds_count", {"tier": "large"}),
        ("router_inter_token_latency_seconds_count", {"tier": "large"}),
        ("router_request_duration_seconds_count", {"tier": "large"}),
        ("router_queue_time_seconds_count", {"tier": "large"}),
        ("router_prompt_tokens_total", {"tier": "large"}),
        ("router_completion_tokens_total", {"tier": "large"}),
        ("router_spec_decode_draft_tokens_total", {"tier": "large"}),
        ("router_spec_decode_steps_total", {"tier": "large"}),
        ("router_classifier_latency_seconds_count", {}),
        ("router_cache_misses_total", {}),
        ("router_engine_steps_total", {"tier": "large"}),
    ]:
        assert total(after, name, **labels) > total(before, name, **labels), name
    assert total(after, "router_spec_decode_accepted_tokens_total", tier="large") >= 0
    assert total(after, "router_running_requests", tier="large") == 0
    assert total(after, "router_waiting_requests", tier="large") == 0
    assert "router_policy_reloads_total" in after and "router_policy_reload_failures_total" in after
    assert after["router_ready"] == 1


def test_dashboard_page_and_data(traced: tuple[Server, Receiver]) -> None:
    srv, _ = traced
    page = httpx.get(srv.url + "/dashboard")
    assert page.status_code == 200 and "tiered-router" in page.text and "dashboard/data" in page.text
    data = httpx.get(srv.url + "/dashboard/data").json()
    assert data["ready"] is True and [t["name"] for t in data["tiers"]] == ["small", "medium", "large"]
    large = data["tiers"][2]
    assert large["requests"].get("ok", 0) >= 1 and large["ttft_s"]["p50"] is not None
