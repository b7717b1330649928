"""A remote tier: the router streams an OpenAI-compatible upstream (here a second instance of this
service on loopback) through, with its own routing headers, metrics and error mapping."""

from __future__ import annotations

import json
import re
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, free_port, start_server


@pytest.fixture(scope="module")
def upstream(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("upstream") / "policy.yaml"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


@pytest.fixture(scope="module")
def front(
    upstream: Server, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    text = f"""
version: 1
tiers:
  small:
    model: {tiny_model_dir}
    quantization: int8
    max_num_seqs: 4
    max_model_len: 256
    defaults: {{max_tokens: 8, temperature: 0}}
  large: {{model: "{upstream.url}/v1", served_model_name: large, max_retries: 1, timeout_s: 30}}
  broken: {{model: "{dead}", max_retries: 1, timeout_s: 5}}
routing:
  rules:
    - {{name: hard, when: {{score_at_least: 0.5}}, tier: large}}
    - {{name: default, tier: small}}
service:
  auth: {{mode: open}}
  cache: {{enabled: false}}
"""
    path = tmp_path_factory.mktemp("front") / "policy.yaml"
    path.write_text(text)
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


def test_remote_tier_non_streaming(front: Server, upstream: Server) -> None:
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="large", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    resp = raw.parse()
    assert raw.headers["x-router-tier"] == "large"
    direct = openai.OpenAI(base_url=upstream.url + "/v1", api_key="x").chat.completions.create(
        model="large", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert resp.choices[0].message.content == direct.choices[0].message.content
    assert resp.usage is not None and resp.usage.completion_tokens == direct.usage.completion_tokens  # type: ignore[union-attr]


def test_remote_tier_streaming_passthrough(front: Server) -> None:
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="large",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(
        model="large", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None


def test_remote_completions(front: Server) -> None:
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    resp = client.completions.create(model="large", prompt="The quick", max_tokens=4, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_unreachable_upstream_is_503_with_retry_after(front: Server) -> None:
    r = httpx.post(
        front.url + "/v1/chat/completions",
        json={"model": "broken", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 503 and "retry-after" in r.headers
    assert r.json()["error"]["code"] == "upstream_unavailable"


def test_upstream_error_is_passed_as_an_openai_error(front: Server) -> None:
    r = httpx.post(
        front.url + "/v1/chat/completions",
        json={
            "model": "large",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 1.0,
            "max_tokens": 10**6,
        },
    )
    assert r.status_code in (200, 400, 502)
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- a misbehaving upstream -------------------------------------------------------------------------
class Flaky:
    """A raw-socket OpenAI-ish upstream whose behaviour the test sets per request (``mode``)."""

    def __init__(self) -> None:
        import socketserver
        import threading

        self.mode = "ok"
        self.requests = 0
        flaky = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                flaky.requests += 1
                flaky.serve(self.request)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve(self, sock: Any) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            part = sock.recv(65536)
            if not part:
                return
            data += part
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))  # type: ignore[union-attr]
        while len(body) < length:
            body += sock.recv(65536)
        mode = self.mode
        if mode == "dead":  # accept, then drop the connection without an answer
            sock.close()
            return
        if mode == "hang":
            time.sleep(3)
            return
        if mode in ("400", "429", "500"):
            status = {
                "400": b"400 Bad Request",
                "429": b"429 Too Many Requests",
                "500": b"500 Internal Server Error",
            }
            payload = {
                "400": b'{"error": {"message": "This model\'s maximum context length is 8 tokens.", '
                b'"type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}',
                "429": b'{"error": {"message": "Upstream is busy.", "type": "rate_limit_error", '
                b'"param": null, "code": "rate_limit_exceeded"}}',
                "500": b"Traceback (most recent call last): secret /srv/internal/path.py",
            }[mode]
            extra = b"retry-after: 7\r\n" if mode == "429" else b""
            sock.sendall(
                b"HTTP/1.1 "
                + status[mode]
                + b"\r\ncontent-type: application/json\r\n"
                + extra
                + b"content-length: "
                + str(len(payload)).encode()
                + b"\r\nconnection: close\r\n\r\n"
                + payload
            )
            return
        sock.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"connection: close\r\n\r\n"
        )

        def chunk(obj: dict[str, Any] | str) -> None:
            line = b"data: " + (obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()) + b"\n\n"
            sock.sendall(f"{len(line):x}\r\n".encode() + line + b"\r\n")

        for word in ("Hello", " from", " upstream"):
            chunk({"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]})
        if mode == "reset":  # RST mid-stream
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            return
        if mode == "truncate":  # a clean end of body, but the answer never finished
            sock.sendall(b"0\r\n\r\n")
            return
        chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
        chunk("[DONE]")
        sock.sendall(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def flaky() -> Flaky:
    return Flaky()


@pytest.fixture(scope="module")
def guarded(flaky: Flaky, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    remote = f"http://127.0.0.1:{flaky.port}/v1"
    text = f"""
version: 1
tiers:
  small:
    model: {tiny_model_dir}
    max_num_seqs: 4
    max_model_len: 256
    defaults: {{max_tokens: 4, temperature: 0}}
  remote: {{model: "{remote}", max_retries: 1, timeout_s: 1.5, circuit_failures: 3, circuit_cooldown_s: 1}}
  lonely: {{model: "{remote}", max_retries: 0, timeout_s: 1.5, circuit_failures: 1, circuit_cooldown_s: 30}}
routing:
  rules:
    - {{name: default, tier: small}}
  fallback: {{remote: small}}
service:
  auth: {{mode: open}}
  cache: {{enabled: true}}
"""
    path = tmp_path_factory.mktemp("guarded") / "policy.yaml"
    path.write_text(text)
    srv, stop = start_server(path, watch_policy=False)
    yield srv
    stop()


def ask(srv: Server, model: str = "remote", stream: bool = False, content: str = "hi") -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "stream": stream,
    }
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)


def sse_text(r: httpx.Response) -> tuple[str, list[dict[str, Any]]]:
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    return text, events


def test_upstream_4xx_pass_through_with_status_body_and_retry_after(guarded: Server, flaky: Flaky) -> None:
    flaky.mode = "400"
    seen = flaky.requests
    r = ask(guarded)
    assert r.status_code == 400 and flaky.requests == seen + 1  # a client error is not retried
    assert r.json()["error"] == {
        "message": "This model's maximum context length is 8 tokens.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    flaky.mode = "429"
    r = ask(guarded, stream=True)
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    assert r.json()["error"]["type"] == "rate_limit_error"
    flaky.mode = "400"
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="remote", messages=[{"role": "user", "content": "hi"}])
    flaky.mode = "ok"


def test_upstream_500_falls_back_without_its_internals(guarded: Server, flaky: Flaky) -> None:
    """A 500 before the first byte: ``routing.fallback`` (remote -> small) answers, and nothing
    of the upstream's body reaches the client (the 502 without a fallback: ``lonely`` below)."""
    flaky.mode = "500"
    seen = flaky.requests
    r = ask(guarded)
    assert r.status_code == 200 and r.headers["x-router-tier"] == "small", r.text
    assert flaky.requests > seen  # asked upstream first
    assert "Traceback" not in r.text and "/srv" not in r.text
    flaky.mode = "ok"
    ok = ask(guarded)  # resets the failure count before the circuit opens
    assert ok.status_code == 200 and ok.headers["x-router-tier"] == "remote"


def test_reset_or_truncated_streams_are_errors_and_never_cached(guarded: Server, flaky: Flaky) -> None:
    for mode in ("reset", "truncate"):
        flaky.mode = mode
        content = f"cut {mode}"
        r = ask(guarded, content=content)
        assert r.status_code == 502, (mode, r.text)
        streamed = ask(guarded, stream=True, content=content)
        assert streamed.status_code == 200  # the stream had started: the error is its last event
        text, events = sse_text(streamed)
        assert text == "Hello from upstream" and "error" in events[-1], mode
        assert all(c.get("finish_reason") != "stop" for e in events for c in e.get("choices", []))
        flaky.mode = "ok"
        again = ask(guarded, content=content)
        assert again.status_code == 200 and again.headers["x-router-cache"] == "miss", mode
        assert ask(guarded, content=content).headers["x-router-cache"] == "hit"


def test_upstream_timeout_falls_back_after_its_timeout(guarded: Server, flaky: Flaky) -> None:
    flaky.mode = "hang"
    started = time.monotonic()
    r = ask(guarded, content="slow")
    assert r.status_code == 200 and r.headers["x-router-tier"] == "small"
    assert time.monotonic() - started < 2.8  # the 1.5 s timeout, not retried
    flaky.mode = "ok"
    assert ask(guarded, content="after the timeout").status_code == 200


def test_dying_upstream_opens_the_circuit_falls_back_and_closes_after_cooldown(
    guarded: Server, flaky: Flaky
) -> None:
    flaky.mode = "dead"
    for _ in range(3):  # circuit_failures: 3; each failure before a byte falls back at once
        seen = flaky.requests
        r = ask(guarded, content="circuit")
        assert r.status_code == 200 and r.headers["x-router-tier"] == "small", r.text
        assert flaky.requests > seen
    seen = flaky.requests
    fallback = ask(guarded, content="circuit")
    assert fallback.status_code == 200 and fallback.headers["x-router-tier"] == "small"
    assert flaky.requests == seen  # the open circuit sends nothing upstream
    time.sleep(1.1)  # circuit_cooldown_s: 1
    flaky.mode = "ok"
    back = ask(guarded, content="circuit back")
    assert back.status_code == 200 and back.headers["x-router-tier"] == "remote"
    assert ask(guarded, content="circuit back 2").headers["x-router-tier"] == "remote"


def test_an_open_circuit_without_fallback_is_a_503_at_once(guarded: Server, flaky: Flaky) -> None:
    flaky.mode = "500"
    r = ask(guarded, model="lonely")  # no fallback: the failure is the answer; circuit_failures: 1
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
    assert "Traceback" not in r.text and "/srv" not in r.text
    flaky.mode = "dead"
    started = time.monotonic()
    r = ask(guarded, model="lonely")
    assert r.status_code == 503 and r.json()["error"]["code"] == "tier_unavailable"
    assert 1 <= int(r.headers["retry-after"]) <= 30 and time.monotonic() - started < 0.5
    flaky.mode = "ok"


def test_a_remote_tier_settles_best_of_without_rewriting_the_request() -> None:
    """Bug it guards: the remote backend wrote ``best_of = n`` into the parsed request's output
    spec so the writer would skip ranking; the typed request is read by every later stage (the
    token rate limit, fair-share weights, the shadow copy) and must stay what the caller asked.
    Now the backend says how many choices it returns (``Served.choices``) and the spec is untouched."""
    import asyncio

    from router.backends.remote import RemoteBackend
    from router.openai.request import parse_completion
    from router.openai.schemas import CompletionRequest
    from router.policy.schema import LimitsConfig, TierConfig

    gen = parse_completion(
        CompletionRequest(model="large", prompt="hi", n=1, best_of=3, max_tokens=4), LimitsConfig()
    )
    backend = RemoteBackend("large", TierConfig(model="http://upstream.invalid/v1"), client=None)  # type: ignore[arg-type]
    prepared = asyncio.run(backend.prepare(gen, 2, grammar_timeout_s=1.0))
    assert gen.output is not None and (gen.output.n, gen.output.best_of) == (1, 3)
    assert prepared.served.choices == 1
    assert prepared.payload["best_of"] == 3  # the upstream is asked for all three
