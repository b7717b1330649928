"""Tool calls read back out of a local tier's output: whole (``parse_tool_calls``) or as they
stream (``ToolCallStreamer``). The format and the grammar that guarantees it are
``router.openai.structured``'s: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``,
one block per call, blocks separated by a newline.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from router.openai.structured import CALL_CLOSE, Tool

__all__ = ["ToolCallStreamer", "call_id", "parse_tool_calls"]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, tools: list[Tool]) -> tuple[str | None, list[dict[str, Any]]]:
    """Split an output into (content, OpenAI ``tool_calls``). Blocks that do not parse or name
    an unknown function stay in the content (the model wrote text that looks like a call)."""
    names = {t.name for t in tools}
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        args = obj.get("arguments", {})
        calls.append(
            {
                "id": call_id(),
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


@dataclass(slots=True)
class _Call:
    index: int
    id: str
    name: str
    args_start: int
    sent: int  # argument chars already sent


@dataclass
class ToolCallStreamer:
    """Turns streamed output text into OpenAI ``delta`` dicts: content deltas, or ``tool_calls``
    deltas (first the call's index, id, type and name, then ``arguments`` fragments).

    Output that may still become a call (a prefix of ``<tool_call>``) is held back until it is
    clear; argument text is held back only by the length of the closing marker, so arguments
    stream as the model writes them. Under the tool grammar the layout is exact (the grammar
    writes the markers and the ``name``/``arguments`` keys); free text is passed through."""

    tools: list[Tool]
    buffer: str = ""
    pos: int = 0
    mode: Literal["undecided", "text", "calls"] = "undecided"
    calls: list[_Call] = field(default_factory=list)
    current: _Call | None = None

    _HEAD = re.compile(r'<tool_call>\n\{"name": "([^"]+)", "arguments": ')
    _TAIL = "}" + CALL_CLOSE

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        self.buffer += text
        deltas: list[dict[str, Any]] = []
        if self.mode == "undecided":
            stripped = self.buffer.lstrip()
            if stripped.startswith("<tool_call>"):
                self.mode = "calls"
                self.pos = len(self.buffer) - len(stripped)
            elif final or (stripped and not "<tool_call>".startswith(stripped[: len("<tool_call>")])):
                self.mode = "text"
            else:
                return deltas
        if self.mode == "text":
            if self.pos < len(self.buffer):
                deltas.append({"content": self.buffer[self.pos :]})
                self.pos = len(self.buffer)
            return deltas
        while True:
            if self.current is None:
                m = self._HEAD.search(self.buffer, self.pos)
                if m is None:
                    break
                call = _Call(len(self.calls), call_id(), m.group(1), m.end(), 0)
                self.calls.append(call)
                self.current = call
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": call.index,
                                "id": call.id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
            call = self.current
            end = self.buffer.find(self._TAIL, call.args_start + call.sent)
            if end >= 0:
                fragment = self.buffer[call.args_start + call.sent : end]
                self.pos = end + len(self._TAIL)
                self.current = None
            else:
                safe = len(self.buffer) - (0 if final else len(self._TAIL))
                fragment = self.buffer[call.args_start + call.sent : max(safe, call.args_start + call.sent)]
            if fragment:
                call.sent += len(fragment)
                deltas.append({"tool_calls": [{"index": call.index, "function": {"arguments": fragment}}]})
            if self.current is not None:
                break
        return deltas
