"""Session-aware routing (router/pipeline/session.py): memory, keys, and a conversation through HTTP."""

from __future__ import annotations

import httpx
import pytest

from router.pipeline.session import SESSION_HEADER, SessionMemory, prior_key, record_key
from tests.router.conftest import Server

U1 = {"role": "user", "content": "Prove that there are infinitely many primes of the form 4k+3."}
A1 = {"role": "assistant", "content": "Suppose there are finitely many..."}
U2 = {"role": "user", "content": "now commit it"}
A2 = {"role": "assistant", "content": "Done."}
U3 = {"role": "user", "content": "thanks!"}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_each_turn_finds_what_the_turn_before_stored() -> None:
    turn1, turn2, turn3 = [U1], [U1, A1, U2], [U1, A1, U2, A2, U3]
    assert prior_key(turn1, {}, None) is None  # a first turn has nothing before it
    assert prior_key(turn2, {}, None) == record_key(turn1, {}, None)
    assert prior_key(turn3, {}, None) == record_key(turn2, {}, None)
    # Assistant turns are not part of the key: a client that reformats them still matches.
    edited = [U1, {"role": "assistant", "content": "(trimmed)"}, U2]
    assert prior_key(edited, {}, None) == prior_key(turn2, {}, None)
    # A different conversation with the same last ask does not.
    other = [{"role": "user", "content": "hello"}, A1, U2]
    assert prior_key(other, {}, None) != prior_key(turn2, {}, None)


def test_keys_are_scoped_by_tenant_and_session_id_wins() -> None:
    turn2 = [U1, A1, U2]
    assert prior_key(turn2, {}, "team-a") != prior_key(turn2, {}, "team-b")
    sid = {SESSION_HEADER: "abc"}
    assert prior_key([U3], sid, None) == record_key([U1], sid, None)  # any messages, one session
    assert prior_key([U3], sid, "team-a") != prior_key([U3], sid, "team-b")


def test_field_boundaries_cannot_collide() -> None:
    a = [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]
    b = [{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]
    assert record_key(a, {}, None) != record_key(b, {}, None)


def test_memory_is_bounded_and_forgets_the_least_recent() -> None:
    mem = SessionMemory(max_entries=3, ttl_s=60)
    for i in range(3):
        mem.put(bytes([i]), "large")
    assert mem.get(bytes([0])) == "large"  # touch 0: now 1 is the least recently used
    mem.put(bytes([3]), "small")
    assert len(mem) == 3 and mem.evictions == 1
    assert mem.get(bytes([1])) is None
    assert mem.get(bytes([0])) == "large" and mem.get(bytes([3])) == "small"
    assert mem.get(None) is None
    with pytest.raises(ValueError, match="max_entries"):
        SessionMemory(max_entries=0)


def test_memory_forgets_idle_conversations() -> None:
    clock = Clock()
    mem = SessionMemory(max_entries=10, ttl_s=30, clock=clock)
    mem.put(b"k", "large")
    clock.t = 20
    assert mem.get(b"k") == "large"  # a use refreshes the clock...
    clock.t = 45
    assert mem.get(b"k") == "large"  # ...so 25 s after it, the conversation is still known
    clock.t = 76
    assert mem.get(b"k") is None  # idle for 31 s > 30 s
    assert len(mem) == 0


def _chat(server: Server, messages: list[dict[str, str]], **headers: str) -> httpx.Response:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "auto", "messages": messages, "max_tokens": 2, "temperature": 0},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


def test_a_three_turn_conversation_stays_on_large(server: Server) -> None:
    first = _chat(server, [U1], **{"x-priority": "high"})
    assert first.headers["x-router-tier"] == "large" and first.headers["x-router-rule"] == "priority-header"
    # The same short follow-up, as a conversation of its own, goes to a cheaper tier...
    alone = _chat(server, [U2])
    assert alone.headers["x-router-tier"] != "large"
    # ...but as turn 2 of the conversation that started on large, it stays there. (The score
    # rule that picked a cheaper tier is named after "session:"; with the proof as context it
    # may be score-medium rather than score-small.)
    second = _chat(server, [U1, A1, U2])
    assert second.headers["x-router-tier"] == "large"
    assert second.headers["x-router-rule"] in ("session:score-small", "session:score-medium")
    preview = httpx.post(server.url + "/v1/route", json={"messages": [U1, A1, U2]}, timeout=30).json()
    assert preview["tier"] == "large" and "session: conversation was on 'large'" in preview["reason"]
    third = _chat(server, [U1, A1, U2, A2, U3])
    assert third.headers["x-router-tier"] == "large"
    assert third.headers["x-router-rule"].startswith("session:")


def test_explicit_session_id_through_http(server: Server) -> None:
    sid = {SESSION_HEADER: "conv-42"}
    _chat(server, [U1], **sid, **{"x-priority": "high"})
    follow = _chat(server, [{"role": "user", "content": "ok, and then?"}], **sid)
    assert follow.headers["x-router-tier"] == "large" and follow.headers["x-router-rule"].startswith(
        "session:"
    )
    other = _chat(server, [{"role": "user", "content": "ok, and then?"}], **{SESSION_HEADER: "conv-43"})
    assert other.headers["x-router-tier"] != "large"


def test_a_tier_forced_by_name_is_not_overridden(server: Server) -> None:
    _chat(server, [U1], **{"x-priority": "high", SESSION_HEADER: "forced"})
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "small", "messages": [U2], "max_tokens": 2},
        headers={SESSION_HEADER: "forced"},
        timeout=60,
    )
    assert r.headers["x-router-tier"] == "small" and r.headers["x-router-rule"] == "model:small"
