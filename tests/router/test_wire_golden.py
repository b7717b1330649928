"""The client-facing bytes of a recorded set of requests, against a golden file.

Catches any change to what a client receives - a field renamed, reordered or dropped, a chunk
split differently, an error shape or status moved - while the router's modules are rearranged:
the golden file was written by the code before the restructure, and every answer here must stay
byte-identical to it. Only what legitimately varies between runs is normalised (ids, ``created``,
generated call and response ids, timings), and floats compare within 1e-4 (``same_wire``: hosts'
torch builds differ in the seventh digit of a logprob); everything else is compared as sent.

The tiny models answer greedily (temperature 0, or a fixed seed), one request at a time, on a
fresh server, so the tokens are the same every run. Regenerate with ``TIERED_ROUTER_UPDATE_GOLDEN=1``
only when a wire change is intended, and say so in the commit.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router.conftest import Server, keyed_tiny_server
from tiers.kernels import cpu as cpu_kernels

GOLDEN = Path(__file__).parent / "golden" / "wire.txt"
KEYS_ENV = "TIERED_ROUTER_TEST_GOLDEN_KEYS"
KEY = "sk-golden-a"
AUTH = {"authorization": f"Bearer {KEY}"}

# Headers a client reads; the rest (date, server, request ids) vary or belong to the transport.
KEPT_HEADERS = (
    "content-type",
    "cache-control",
    "retry-after",
    "x-router-tier",
    "x-router-score",
    "x-router-rule",
    "x-router-cache",
    "x-router-fallback",
)

# (pattern, replacement) over the body bytes: ids minted per request and wall-clock fields.
IDS = "call_id|tool_use_id|previous_response_id|response_id|item_id"
NORMALISE: list[tuple[re.Pattern[bytes], bytes]] = [
    (re.compile(rb'"id": ?"(chatcmpl|cmpl|call|resp|msg|fc|toolu|rs)[-_][A-Za-z0-9_-]+"'), rb'"id":"\1-*"'),
    (re.compile(rb'"(' + IDS.encode() + rb')": ?"([a-z]+)[-_][A-Za-z0-9_-]+"'), rb'"\1":"\2-*"'),
    (re.compile(rb'"(created|created_at|completed_at)": ?[0-9.]+'), rb'"\1":0'),
    (re.compile(rb'"([a-z_]+_ms)": ?[0-9.]+'), rb'"\1":0'),  # timings
    (re.compile(rb'"policy": ?"[0-9a-f]{12}"'), rb'"policy":"*"'),  # hashes the policy file's path
]

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["paris", "tokyo", "lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "ok", "count"],
    "additionalProperties": False,
}
HI = [{"role": "user", "content": "hi"}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any] | bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    body_is_interleaved: bool = False  # an SSE answer with n > 1 (see order_choices)


def chat(name: str, **body: Any) -> Case:
    return Case(name, CHAT, {"model": "small", "messages": HI, "max_tokens": 6, "temperature": 0, **body})


def completion(name: str, **body: Any) -> Case:
    return Case(
        name,
        COMPLETIONS,
        {"model": "small", "prompt": "The quick", "max_tokens": 6, "temperature": 0, **body},
    )


CASES: list[Case] = [
    # Chat, plain and streamed, on each tier and routed.
    chat("chat-small"),
    chat("chat-medium-speculating", model="medium"),
    chat("chat-large", model="large"),
    chat("chat-auto", model="auto"),
    chat("chat-alias", model="fast"),
    Case(
        "chat-priority-header",
        CHAT,
        {"model": "auto", "messages": HI, "max_tokens": 3, "temperature": 0},
        {"x-priority": "high"},
    ),
    chat("chat-stream", stream=True),
    chat("chat-stream-usage", model="medium", stream=True, stream_options={"include_usage": True}),
    chat("chat-stop", messages=ASK, max_tokens=12, stop=["e"]),
    chat(
        "chat-system-and-history",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ],
    ),
    chat(
        "chat-content-parts", messages=[{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]
    ),
    chat("chat-seeded-sampling", temperature=0.9, top_p=0.8, seed=11, max_tokens=8),
    chat("chat-penalties", presence_penalty=0.5, frequency_penalty=0.5, max_tokens=8),
    chat("chat-ignore-eos-length", max_tokens=10, ignore_eos=True),
    chat("chat-max-completion-tokens", max_tokens=None, max_completion_tokens=4),
    # Logprobs, n > 1.
    chat("chat-logprobs", logprobs=True, top_logprobs=2, max_tokens=4),
    chat("chat-logprobs-stream", logprobs=True, top_logprobs=2, max_tokens=4, stream=True),
    chat("chat-n2-seeded", n=2, temperature=1.0, seed=7, max_tokens=5),
    replace(
        chat(
            "chat-n2-stream",
            n=2,
            temperature=1.0,
            seed=7,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        ),
        body_is_interleaved=True,
    ),
    # Structured output.
    chat(
        "chat-json-schema",
        messages=ASK,
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        },
    ),
    chat(
        "chat-json-schema-stream",
        model="medium",
        messages=ASK,
        max_tokens=60,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    ),
    chat("chat-json-object", messages=ASK, max_tokens=20, response_format={"type": "json_object"}),
    # Tools.
    chat(
        "chat-tool-forced",
        messages=ASK,
        max_tokens=150,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ),
    chat(
        "chat-tool-required-stream",
        messages=ASK,
        max_tokens=150,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
    ),
    chat("chat-tool-auto", messages=ASK, max_tokens=20, tools=[WEATHER_TOOL]),
    chat("chat-tool-none", messages=ASK, max_tokens=6, tools=[WEATHER_TOOL], tool_choice="none"),
    chat(
        "chat-tool-history",
        max_tokens=6,
        tools=[WEATHER_TOOL],
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"paris","days":1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ],
    ),
    # Completions.
    completion("completion"),
    completion("completion-stream", stream=True, stream_options={"include_usage": True}),
    completion("completion-logprobs", logprobs=2, max_tokens=3),
    replace(
        completion("completion-n2-stream", n=2, temperature=1.0, seed=5, max_tokens=4, stream=True),
        body_is_interleaved=True,
    ),
    completion("completion-n2", n=2, temperature=1.0, seed=5, max_tokens=4),
    completion("completion-best-of", n=1, best_of=2, temperature=1.0, seed=5, max_tokens=4),
    completion("completion-prompt-list", prompt=["The quick", "Hello there"], n=2, max_tokens=3),
    # Other endpoints a client reads.
    Case("models", "/v1/models", method="GET"),
    Case("model-one", "/v1/models/small", method="GET"),
    Case("route", "/v1/route", {"model": "auto", "messages": HI}),
    Case(
        "responses",
        "/v1/responses",
        {"model": "small", "input": "hi", "max_output_tokens": 6, "temperature": 0},
    ),
    Case(
        "responses-stream",
        "/v1/responses",
        {"model": "small", "input": "hi", "max_output_tokens": 5, "temperature": 0, "stream": True},
    ),
    Case("messages", "/v1/messages", {"model": "small", "max_tokens": 6, "temperature": 0, "messages": HI}),
    Case(
        "messages-stream",
        "/v1/messages",
        {"model": "small", "max_tokens": 5, "temperature": 0, "messages": HI, "stream": True},
    ),
    # Errors.
    Case(
        "error-unauthenticated",
        CHAT,
        {"model": "small", "messages": HI},
        {"authorization": "Bearer sk-wrong"},
    ),
    chat("error-unknown-model", model="nope"),
    chat("error-unknown-field", frobnicate=True),
    chat("error-wrong-type", temperature="hot"),
    chat("error-out-of-range", top_p=0),
    chat("error-n-too-large", n=17),
    chat("error-bad-role", messages=[{"role": "wizard", "content": "x"}]),
    chat("error-empty-messages", messages=[]),
    chat("error-refused-field", audio={"voice": "alloy", "format": "wav"}),
    Case("error-missing-model", CHAT, {"messages": HI}),
    Case("error-malformed-json", CHAT, b"{oops"),
    Case(
        "error-non-finite",
        CHAT,
        b'{"model":"small","messages":[{"role":"user","content":"x"}],"temperature":NaN}',
    ),
    completion("error-too-long", prompt=" ".join(["word"] * 1200)),
    chat(
        "error-unenforceable-schema",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
        },
    ),
    chat(
        "error-strict-schema-not-closed",
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "a",
                "strict": True,
                "schema": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
        },
    ),
    chat(
        "error-bad-tool-schema",
        tool_choice="required",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
    ),
    Case("error-messages-unknown-model", "/v1/messages", {"model": "nope", "max_tokens": 2, "messages": HI}),
    Case(
        "error-responses-unknown-field",
        "/v1/responses",
        {"model": "small", "input": "hi", "max_output_token": 2},
    ),
]


FINGERPRINT = re.compile(r"fp_[0-9a-f]{10}")


def normalise(body: bytes) -> bytes:
    for pattern, replacement in NORMALISE:
        body = pattern.sub(replacement, body)
    return body


FLOAT = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?")
FLOAT_TOLERANCE = 1e-4
"""Floats (logprobs, scores) compare within this: torch's CPU builds sum a log-softmax in another
order on another instruction set (AVX512 vs AVX2: logprobs 2.4e-7 apart, measured), which is not a
wire change. Everything else, tokens included, compares byte for byte."""


def same_wire(recorded: str, golden: str) -> bool:
    """Byte for byte outside float literals; float literals in the same places, each within
    ``FLOAT_TOLERANCE``."""
    if recorded == golden:
        return True
    if FLOAT.sub("<float>", recorded) != FLOAT.sub("<float>", golden):
        return False
    pairs = zip(FLOAT.findall(recorded), FLOAT.findall(golden), strict=True)
    return all(abs(float(a) - float(b)) <= FLOAT_TOLERANCE for a, b in pairs)


def test_the_wire_comparison_tolerates_float_noise_only() -> None:
    """Catches a comparison that lets a changed field, token or order through along with the
    floats, or one that fails on a host whose logprobs differ in the seventh digit."""
    golden = '{"token":"fo","logprob":-2.027334690093994,"top":[0.5]}'
    assert same_wire('{"token":"fo","logprob":-2.027334451675415,"top":[0.5]}', golden)
    assert not same_wire('{"token":"fo","logprob":-2.0283,"top":[0.5]}', golden)
    assert not same_wire('{"token":"fO","logprob":-2.027334690093994,"top":[0.5]}', golden)
    assert not same_wire('{"token":"fo","logprob":-2.027334690093994,"top":[0.5,0.1]}', golden)
    assert not same_wire('{"token":"fo","logprobs":-2.027334690093994,"top":[0.5]}', golden)


def number_fingerprints(text: str) -> str:
    """``system_fingerprint`` hashes the tier's configuration, model path included (a tmp dir
    here); each distinct one becomes ``fp_<n>`` in order of first appearance, so the golden file
    still shows which answers share a configuration."""
    seen: dict[str, str] = {}
    return FINGERPRINT.sub(lambda m: seen.setdefault(m.group(0), f"fp_{len(seen)}"), text)


CHOICE_INDEX = re.compile(rb'^data: \{.*"choices":\[\{"index":(\d+),')


def order_choices(body: bytes) -> bytes:
    """The events of an SSE body with n > 1, each choice's in its own order, choice 0's first.

    The sequences of one request are generated side by side and their tokens reach the stream
    as each is sampled, so how the choices interleave is timing; what each choice sends, and in
    which order, is not. Events that carry no one choice (usage, ``[DONE]``) keep their places."""
    events = body.split(b"\n\n")
    indexed = [(i, m) for i, e in enumerate(events) if (m := CHOICE_INDEX.match(e))]
    ordered = sorted(indexed, key=lambda im: int(im[1].group(1)))  # stable: keeps each choice's order
    out = list(events)
    for (slot, _), (source, _) in zip(indexed, ordered, strict=True):
        out[slot] = events[source]
    return b"\n\n".join(out)


def record(client: httpx.Client, case: Case) -> str:
    headers = {**AUTH, **case.headers}
    if isinstance(case.body, bytes):
        r = client.request(
            case.method, case.path, content=case.body, headers={**headers, "content-type": "application/json"}
        )
    elif case.body is None:
        r = client.request(case.method, case.path, headers=headers)
    else:
        body = {k: v for k, v in case.body.items() if v is not None}
        r = client.request(case.method, case.path, json=body, headers=headers)
    kept = [f"{name}: {r.headers[name]}" for name in KEPT_HEADERS if name in r.headers]
    content = order_choices(r.content) if case.body_is_interleaved else r.content
    text = normalise(content).decode("utf-8", errors="backslashreplace")
    return "\n".join([f"=== {case.name}: {case.method} {case.path} -> {r.status_code}", *kept, "", text, ""])


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # torch's own kernels, whether or not this checkout built tiers/kernels/csrc: with the build, attention
    # runs the paged kernel instead of gather + SDPA, and the tiny tiers' logprobs move by ~2e-3
    # (tokens too, near ties). The wire format is what this test pins, on every host alike.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_kernels, "_library_loaded", lambda: False)
        with keyed_tiny_server(
            tiny_model_dir, tmp_path_factory.mktemp("golden"), KEYS_ENV, f"{KEY}:team-a", drafts=False
        ) as srv:
            yield srv


def test_case_names_are_unique() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)) and len(names) >= 50


def test_wire_output_is_byte_identical_to_the_golden_file(server: Server, tmp_path: Path) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        recorded = number_fingerprints("".join(record(client, case) for case in CASES))
        server.wait_idle()
    if os.environ.get("TIERED_ROUTER_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(recorded, encoding="utf-8")
    golden = GOLDEN.read_text(encoding="utf-8")
    if not same_wire(recorded, golden):
        diff = difflib.unified_diff(
            golden.splitlines(), recorded.splitlines(), "golden", "now", lineterm="", n=1
        )
        (tmp_path / "wire.txt").write_text(recorded, encoding="utf-8")
        pytest.fail(
            f"wire output changed (whole recording: {tmp_path / 'wire.txt'}):\n" + "\n".join(list(diff)[:80])
        )
    # The recording is not vacuous: every kind of answer is in it.
    assert recorded.count("-> 200") >= 35 and recorded.count("-> 400") >= 10
    assert "data: [DONE]" in recorded and '"tool_calls"' in recorded and '"logprobs"' in recorded
    first = recorded.split("\n\n", 1)[1].split("\n", 1)[0]
    assert json.loads(first)["object"] == "chat.completion"
