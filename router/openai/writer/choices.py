"""One choice of an answer as it grows (``ChoiceBuilder``): its text, tool calls and logprobs,
the stream chunks' ``choices`` items it yields and its final body item; ``aggregate`` sums an
answer's accounting over its choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.openai.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
    prompt_completion_logprobs,
)
from router.openai.structured import OutputSpec
from router.openai.tools import ToolCallStreamer, parse_tool_calls
from tiers.core.output import StepOutput

__all__ = ["ChoiceBuilder", "aggregate"]


@dataclass
class _RemoteCall:
    id: str | None = None
    name: str = ""
    arguments: str = ""


@dataclass
class ChoiceBuilder:
    """The state of one choice. ``add`` returns the stream chunks' ``choices`` items it makes."""

    index: int
    kind: str  # chat | completion
    spec: OutputSpec
    texts: TokenTexts | None
    prompt_text: str = ""
    """The prompt, for completions ``echo``."""
    parts: list[str] = field(default_factory=list)
    entries: list[Any] = field(default_factory=list)
    wire_logprobs: list[Any] = field(default_factory=list)
    remote_calls: dict[int, _RemoteCall] = field(default_factory=dict)
    last: StepOutput | None = None
    streamer: ToolCallStreamer | None = None
    streamed_calls: bool = False
    _offset: int = 0

    def __post_init__(self) -> None:
        if self.kind == "chat" and self.spec.parses_tool_calls:
            self.streamer = ToolCallStreamer(self.spec.tools)
        if self.spec.echo:
            self._offset = len(self.prompt_text)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None

    @property
    def mean_logprob(self) -> float:
        if not self.entries:
            return float("-inf")
        return sum(e.logprob for e in self.entries) / len(self.entries)

    def _logprobs_of(self, out: StepOutput) -> Any:
        if out.wire_logprobs is not None:
            return out.wire_logprobs
        if self.spec.logprobs is None or not out.logprobs or self.texts is None:
            return None
        if self.kind == "chat":
            return {"content": chat_logprobs(self.texts, out.logprobs, self.spec.logprobs), "refusal": None}
        lp = completion_logprobs(self.texts, list(out.logprobs), self.spec.logprobs, self._offset)
        self._offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else self._offset
        return lp

    def add(self, out: StepOutput) -> list[dict[str, Any]]:
        self.last = out
        if out.text:
            self.parts.append(out.text)
        if out.logprobs:
            self.entries.extend(out.logprobs)
        logprobs = self._logprobs_of(out)
        if out.prompt_logprobs is not None and self.texts is not None and self.spec.logprobs is not None:
            # Echo with logprobs: the prompt's tokens come first, with the first output.
            head = prompt_completion_logprobs(
                self.texts, out.prompt_token_ids or [], out.prompt_logprobs, self.spec.logprobs
            )
            logprobs = head if logprobs is None else merge_completion_logprobs([head, logprobs])
        if logprobs is not None:
            self.wire_logprobs.append(logprobs)
        items: list[dict[str, Any]] = []
        if self.kind != "chat":
            if out.text or logprobs is not None:
                items.append(self._item(out.text, logprobs))
            return items
        deltas: list[dict[str, Any]] = []
        if out.tool_calls:
            self._add_remote_calls(out.tool_calls)
            deltas.append({"tool_calls": out.tool_calls})
        if self.streamer is not None:
            deltas.extend(self.streamer.feed(out.text, final=out.finish_reason is not None))
        elif out.text:
            deltas.append({"content": out.text})
        if any("tool_calls" in d for d in deltas):
            self.streamed_calls = True
        for i, delta in enumerate(deltas):
            items.append(self._item(delta, logprobs if i == 0 else None))
        if not deltas and logprobs is not None:
            items.append(self._item({}, logprobs))
        return items

    def _add_remote_calls(self, calls: list[dict[str, Any]]) -> None:
        for c in calls:
            call = self.remote_calls.setdefault(int(c.get("index", 0)), _RemoteCall())
            call.id = c.get("id") or call.id
            fn = c.get("function") or {}
            call.name += fn.get("name") or ""
            call.arguments += fn.get("arguments") or ""

    def _item(self, delta: Any, logprobs: Any, finish: str | None = None) -> dict[str, Any]:
        item: dict[str, Any] = {"index": self.index}
        item["delta" if self.kind == "chat" else "text"] = delta
        item["logprobs"] = logprobs
        item["finish_reason"] = finish
        return item

    def finish_reason(self, has_calls: bool) -> str | None:
        reason = self.last.finish_reason if self.last is not None else None
        # OpenAI: "tool_calls" when the model called a tool; a call cut by max_tokens stays "length".
        return "tool_calls" if has_calls and reason == "stop" else reason

    def first_items(self) -> list[dict[str, Any]]:
        """Stream chunks that open the choice: the role (chat), the echoed prompt (completions)."""
        if self.kind == "chat":
            return [self._item({"role": "assistant", "content": ""}, None)]
        if self.spec.echo and self.prompt_text:
            return [self._item(self.prompt_text, None)]
        return []

    def final_items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if self.streamer is not None:
            for delta in self.streamer.feed("", final=True):
                items.append(self._item(delta, None))
                self.streamed_calls = self.streamed_calls or "tool_calls" in delta
        has_calls = self.streamed_calls or bool(self.remote_calls)
        items.append(self._item({} if self.kind == "chat" else "", None, self.finish_reason(has_calls)))
        return items

    def body(self) -> dict[str, Any]:
        """The choice of a non-streamed answer."""
        text = self.text
        logprobs: Any = None
        if self.kind == "chat":
            if self.wire_logprobs:
                content: list[Any] = []
                for lp in self.wire_logprobs:
                    content.extend((lp or {}).get("content") or [])
                logprobs = {"content": content, "refusal": None}
            calls: list[dict[str, Any]] = []
            content_text: str | None = text
            if self.remote_calls:
                calls = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for _, c in sorted(self.remote_calls.items())
                ]
            elif self.spec.parses_tool_calls:
                content_text, calls = parse_tool_calls(text, self.spec.tools)
            message: dict[str, Any] = {"role": "assistant", "content": content_text, "refusal": None}
            if calls:
                message["tool_calls"] = calls
            return {
                "index": self.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self.finish_reason(bool(calls)),
            }
        if self.wire_logprobs:
            logprobs = merge_completion_logprobs(self.wire_logprobs)
        if self.spec.echo:
            text = self.prompt_text + text
        finish = self.finish_reason(False)
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def aggregate(choices: list[ChoiceBuilder]) -> StepOutput:
    """One ``StepOutput`` with the whole answer's accounting: the prompt once, every choice's
    generated, drafted and accepted tokens summed; timings of the first choice."""
    lasts = [c.last for c in choices if c.last is not None]
    first = lasts[0] if lasts else StepOutput("", [])
    return StepOutput(
        text="",
        token_ids=[],
        finish_reason=first.finish_reason,
        num_prompt_tokens=max((o.num_prompt_tokens for o in lasts), default=0),
        num_output_tokens=sum(o.num_output_tokens for o in lasts),
        num_cached_tokens=max((o.num_cached_tokens for o in lasts), default=0),
        num_draft_tokens=sum(o.num_draft_tokens for o in lasts),
        num_accepted_tokens=sum(o.num_accepted_tokens for o in lasts),
        timings=first.timings,
    )
