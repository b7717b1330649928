"""One choice as it grows (router/openai/writer/choices.py, ``ChoiceBuilder`` and ``aggregate``),
fed engine outputs by hand and read against OpenAI's wire shapes: the streamed deltas joined are
the body's text, nothing of the last output is lost, a remote tier's tool-call fragments are
joined per call index, the finish reason follows OpenAI's rule (``tool_calls`` only when a call
ended with ``stop``), echo puts the prompt first, and the answer's accounting sums choices."""

from __future__ import annotations

from router.openai.structured import OutputSpec
from router.openai.writer.choices import ChoiceBuilder, aggregate
from tiers.core.output import StepOutput


def _chat(index: int = 0) -> ChoiceBuilder:
    return ChoiceBuilder(index=index, kind="chat", spec=OutputSpec(), texts=None)


def _completion(*, echo: bool = False, prompt: str = "") -> ChoiceBuilder:
    return ChoiceBuilder(
        index=0, kind="completion", spec=OutputSpec(echo=echo), texts=None, prompt_text=prompt
    )


def test_streamed_chat_deltas_join_to_the_body_text_last_characters_included() -> None:
    """Bug it catches: the final output's text dropped (its finish step also carries text) - a
    streamed answer that loses its last characters while the body keeps them, or both do."""
    c = _chat(2)
    items = c.first_items()
    assert items == [
        {"index": 2, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    for out in (StepOutput("Hel", [1]), StepOutput("", [2]), StepOutput("lo!", [3, 4], finish_reason="stop")):
        items += c.add(out)
    items += c.final_items()
    streamed = "".join(i["delta"].get("content", "") for i in items)
    assert streamed == "Hello!" == c.text
    assert all(i["index"] == 2 for i in items)
    assert [i["finish_reason"] for i in items].count("stop") == 1 and items[-1]["finish_reason"] == "stop"
    body = c.body()
    assert body["message"] == {"role": "assistant", "content": "Hello!", "refusal": None}
    assert (body["index"], body["finish_reason"], body["logprobs"]) == (2, "stop", None)


def test_an_output_with_no_text_makes_no_empty_content_delta() -> None:
    c = _chat()
    assert c.add(StepOutput("", [7])) == []
    assert c.add(StepOutput("a", [8])) == [
        {"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}
    ]


def test_a_length_finish_stays_length() -> None:
    c = _chat()
    c.add(StepOutput("abc", [1, 2, 3], finish_reason="length"))
    assert c.final_items()[-1]["finish_reason"] == "length"
    assert c.body()["finish_reason"] == "length"
    assert c.finished


def test_remote_tool_call_fragments_join_per_call_and_finish_as_tool_calls() -> None:
    """Bugs it catches: fragments of call 1 appended to call 0, the call id lost when a later
    fragment carries none, ``stop`` not turned into ``tool_calls``."""
    c = _chat()
    first = [
        {"index": 0, "id": "call_a", "function": {"name": "get_", "arguments": '{"ci'}},
        {"index": 1, "id": "call_b", "function": {"name": "time", "arguments": ""}},
    ]
    items = c.add(StepOutput("", [], tool_calls=first))
    assert items[0]["delta"] == {"tool_calls": first}
    c.add(
        StepOutput("", [], tool_calls=[{"index": 0, "function": {"name": "weather", "arguments": 'ty": 1}'}}])
    )
    c.add(
        StepOutput("", [], finish_reason="stop", tool_calls=[{"index": 1, "function": {"arguments": "{}"}}])
    )
    body = c.body()
    assert body["message"]["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": 1}'}},
        {"id": "call_b", "type": "function", "function": {"name": "time", "arguments": "{}"}},
    ]
    assert body["finish_reason"] == "tool_calls"
    assert c.final_items()[-1]["finish_reason"] == "tool_calls"


def test_a_tool_call_cut_by_the_token_limit_stays_length() -> None:
    c = _chat()
    c.add(
        StepOutput(
            "", [], finish_reason="length", tool_calls=[{"index": 0, "id": "c", "function": {"name": "f"}}]
        )
    )
    assert c.body()["finish_reason"] == "length"
    assert c.finish_reason(True) == "length"
    assert c.finish_reason(False) == "length"


def test_completion_text_items_and_echo_put_the_prompt_first() -> None:
    c = _completion(echo=True, prompt="Q: 2+2? A:")
    assert c.first_items() == [{"index": 0, "text": "Q: 2+2? A:", "logprobs": None, "finish_reason": None}]
    items = c.add(StepOutput(" 4", [5], finish_reason="stop"))
    assert items == [{"index": 0, "text": " 4", "logprobs": None, "finish_reason": None}]
    assert c.final_items() == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
    assert c.body() == {"index": 0, "text": "Q: 2+2? A: 4", "logprobs": None, "finish_reason": "stop"}
    plain = _completion(prompt="ignored")
    assert plain.first_items() == []
    plain.add(StepOutput("x", [1], finish_reason="length"))
    assert plain.body()["text"] == "x"


def test_remote_wire_logprobs_pass_through_and_chat_bodies_join_their_content() -> None:
    c = _chat()
    a = {"content": [{"token": "a", "logprob": -0.5}], "refusal": None}
    b = {"content": [{"token": "b", "logprob": -1.5}], "refusal": None}
    first = c.add(StepOutput("a", [1], wire_logprobs=a))
    assert first[0]["logprobs"] is a
    c.add(StepOutput("b", [2], finish_reason="stop", wire_logprobs=b))
    assert c.body()["logprobs"] == {"content": [*a["content"], *b["content"]], "refusal": None}


def test_aggregate_counts_the_prompt_once_and_sums_what_each_choice_generated() -> None:
    """Bugs it catches: the prompt summed over choices (n times the prompt tokens billed), the
    drafted or accepted counts taken from one choice only."""
    choices = [_chat(0), _chat(1)]
    choices[0].add(
        StepOutput(
            "a",
            [1],
            finish_reason="stop",
            num_prompt_tokens=12,
            num_output_tokens=3,
            num_cached_tokens=8,
            num_draft_tokens=4,
            num_accepted_tokens=2,
            timings={"arrival": 1.0},
        )
    )
    choices[1].add(
        StepOutput(
            "b",
            [2],
            finish_reason="length",
            num_prompt_tokens=12,
            num_output_tokens=5,
            num_cached_tokens=8,
            num_draft_tokens=6,
            num_accepted_tokens=5,
            timings={"arrival": 2.0},
        )
    )
    total = aggregate(choices)
    assert (total.num_prompt_tokens, total.num_output_tokens, total.num_cached_tokens) == (12, 8, 8)
    assert (total.num_draft_tokens, total.num_accepted_tokens) == (10, 7)
    assert total.finish_reason == "stop" and total.timings == {"arrival": 1.0}
    empty = aggregate([_chat()])
    assert (empty.num_prompt_tokens, empty.num_output_tokens, empty.finish_reason) == (0, 0, None)


def test_mean_logprob_is_minus_infinity_without_entries() -> None:
    assert _chat().mean_logprob == float("-inf")
