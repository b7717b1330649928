"""The service through the official ``openai`` client and raw HTTP, on tiny models."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from tests.router.conftest import Server

SIMPLE = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_auto_tiers_and_aliases(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[:4] == ["auto", "small", "medium", "large"] and "fast" in ids


def test_chat_completion_with_routing_headers(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=SIMPLE, max_tokens=8, temperature=0
    )
    resp = raw.parse()
    assert raw.headers["x-router-tier"] in ("small", "medium", "large")
    assert 0.0 <= float(raw.headers["x-router-score"]) <= 1.0
    assert raw.headers["x-router-rule"].startswith("score-")
    assert resp.object == "chat.completion" and resp.model == raw.headers["x-router-tier"]
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_chunks_and_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="large",
        messages=SIMPLE,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    again = client.chat.completions.create(model="large", messages=SIMPLE, max_tokens=10, temperature=0)
    assert text == again.choices[0].message.content  # streaming and not: the same greedy answer
    assert chunks[-1].usage.completion_tokens == again.usage.completion_tokens  # type: ignore[union-attr]


def test_completions_endpoint(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="small", prompt="The quick brown", max_tokens=5, temperature=0)
    assert resp.object == "text_completion" and resp.choices[0].finish_reason in ("stop", "length")
    pieces = list(
        client.completions.create(
            model="small", prompt="The quick brown", max_tokens=5, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == resp.choices[0].text


def test_forced_tier_and_alias(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(model="fast", messages=SIMPLE, max_tokens=2)
    assert raw.headers["x-router-tier"] == "small" and raw.headers["x-router-rule"] == "alias:fast"
    raw = client.chat.completions.with_raw_response.create(model="medium", messages=SIMPLE, max_tokens=2)
    assert raw.headers["x-router-tier"] == "medium" and raw.headers["x-router-rule"] == "model:medium"


def test_header_rule(server: Server) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"x-priority": "high"},
        json={"model": "auto", "messages": SIMPLE, "max_tokens": 2},
    )
    assert r.status_code == 200 and r.headers["x-router-rule"] == "priority-header"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=SIMPLE)
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == "model" and err["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 3.5),
        ("top_p", 0),
        ("presence_penalty", -9),
        ("frequency_penalty", 2.5),
        ("n", 17),  # n > 1 is served; past MAX_N (16) it is refused
        ("max_tokens", 0),
    ],
)
def test_out_of_range_params_are_400_naming_the_param(
    client: openai.OpenAI, field: str, value: float
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="auto", messages=SIMPLE, **{field: value})  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == field and body["type"] == "invalid_request_error"


def error_of(r: httpx.Response) -> dict[str, object]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def test_wrong_types_and_missing_fields(server: Server) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions", json={"model": "auto", "messages": SIMPLE, "temperature": "hot"}
    )
    assert r.status_code == 400 and error_of(r)["param"] == "temperature"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": SIMPLE})
    assert r.status_code == 400 and error_of(r)["param"] == "model"
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "wizard", "content": "x"}]},
    )
    assert r.status_code == 400 and "role" in str(error_of(r)["param"])
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "auto", "messages": []})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"


def test_non_finite_and_malformed_json(server: Server) -> None:
    headers = {"content-type": "application/json"}
    for body in (
        b'{"model":"auto","messages":[{"role":"user","content":"x"}],"temperature":NaN}',
        b"{oops",
        b"",
        b"[1,2]",
    ):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == 400, body
        error_of(r)


def test_unknown_fields_are_400_naming_them(client: openai.OpenAI) -> None:
    # OpenAI's own policy: a misspelt field must not be a 200 that silently ignores it.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="small", messages=SIMPLE, max_tokens=2, extra_body={"frobnicate": True}
        )
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == "frobnicate"
    assert "Unrecognized request argument supplied: frobnicate" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="small", prompt="hi", max_tokens=2, extra_body={"respone_format": {}})
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "respone_format"
    # Inside messages, response-only keys that clients send back are ignored.
    resp = client.chat.completions.create(
        model="small",
        max_tokens=2,
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "refusal": None, "annotations": []},  # type: ignore[misc,list-item]
            {"role": "user", "content": "again"},
        ],
    )
    assert resp.choices


def test_body_over_limit_is_413(server: Server) -> None:
    big = "x" * (1_048_576 + 10)
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "user", "content": big}]},
    )
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


def test_prompt_over_context_is_400_and_max_tokens_is_clamped(server: Server, client: openai.OpenAI) -> None:
    """A prompt past the window is a 400; so is a ``max_tokens`` larger than the whole window (as
    vLLM refuses it); one that fits the window but not beside the prompt ends at the window."""
    long = " ".join(["word"] * 400)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="small", prompt=long, max_tokens=5)
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "context_length_exceeded"
    prompt = " ".join(["word"] * 30)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="small", prompt=prompt, max_tokens=257)  # the window is 256
    assert isinstance(info.value.body, dict)
    assert (info.value.body["param"], info.value.body["code"]) == ("max_tokens", "context_length_exceeded")
    resp = client.completions.create(
        model="small", prompt=prompt, max_tokens=256, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage is not None and resp.usage.prompt_tokens + resp.usage.completion_tokens == 256
    assert resp.choices[0].finish_reason == "length"


def test_route_endpoint(server: Server) -> None:
    r = httpx.post(
        server.url + "/v1/route",
        json={"messages": [{"role": "user", "content": "Prove Fermat's little theorem."}]},
    )
    assert r.status_code == 200
    info = r.json()
    assert info["tier"] in ("small", "medium", "large") and set(info["probabilities"]) == {
        "small",
        "medium",
        "large",
    }
    assert r.headers["x-router-rule"] == info["rule"]
    assert httpx.post(server.url + "/v1/route", json={}).status_code == 400


def test_health_ready_metrics_openapi(server: Server) -> None:
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(server.url + "/readyz").status_code == 200
    assert "router_requests_total" in httpx.get(server.url + "/metrics").text
    spec = httpx.get(server.url + "/schema/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/route"):
        assert path in spec["paths"]
    body = spec["paths"]["/v1/chat/completions"]["post"]
    assert "requestBody" in body and {"200", "400", "404", "429"} <= set(body["responses"])


def test_streaming_disconnect_frees_the_slot(server: Server) -> None:
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={"model": "large", "messages": SIMPLE, "max_tokens": 200, "stream": True, "ignore_eos": True},
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.engine("large").load().num_running == 1
    server.wait_idle()


def test_non_streaming_disconnect_frees_the_slot(server: Server) -> None:
    async def go() -> None:
        async with httpx.AsyncClient() as c:
            task = asyncio.create_task(
                c.post(
                    server.url + "/v1/chat/completions",
                    json={"model": "large", "messages": SIMPLE, "max_tokens": 200, "ignore_eos": True},
                )
            )
            for _ in range(200):
                if server.engine("large").load().num_running:
                    break
                await asyncio.sleep(0.01)
            task.cancel()

    asyncio.run(go())
    server.wait_idle()


def test_generation_error_fails_only_that_request(server: Server, client: openai.OpenAI) -> None:
    engine = server.engine("small")

    def hook(batch: object) -> None:
        if any(s.params.max_tokens == 7 for s in batch.seqs):  # type: ignore[attr-defined]
            raise RuntimeError("injected")

    engine.step_hook = hook
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="small", messages=SIMPLE, max_tokens=7)
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "generation_error"
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            json={"model": "small", "messages": SIMPLE, "max_tokens": 7, "stream": True},
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "error" in events[-1]
        ok = client.chat.completions.create(model="small", messages=SIMPLE, max_tokens=3)
        assert ok.choices
    finally:
        engine.step_hook = None


def test_concurrent_requests_are_answered_once_each(client: openai.OpenAI) -> None:
    results: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        r = client.chat.completions.create(
            model="medium", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=6, temperature=0
        )
        with lock:
            results.append(r.id)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12 and len(set(results)) == 12


def test_metrics_move(server: Server, client: openai.OpenAI) -> None:
    before = httpx.get(server.url + "/metrics").text
    client.chat.completions.create(model="large", messages=SIMPLE, max_tokens=4)
    time.sleep(0.05)
    after = httpx.get(server.url + "/metrics").text
    assert before != after


def test_retrieve_one_model(client: openai.OpenAI) -> None:
    assert client.models.retrieve("auto").id == "auto"
    assert client.models.retrieve("fast").id == "fast"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_tool_shaped_messages_are_accepted_and_images_refused(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="small",
        max_tokens=3,
        messages=[
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": [{"type": "text", "text": "What is 6 times 7?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "user", "content": "thanks"},
        ],
        tools=[
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
            }
        ],
        tool_choice="none",
    )
    assert resp.choices[0].message.role == "assistant"
    # The models read text only: an image part is refused, not silently dropped.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="small",
            max_tokens=3,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this picture?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ],
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "messages[0].content[1].type"
