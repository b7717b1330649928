"""Tool calls for local tiers: how tools reach the prompt, the grammar a call is decoded under, and
how calls are read back out of the output (whole, or incrementally while streaming).

The format (Hermes/Qwen2.5 style, which instruction-tuned models have seen most):

    <tool_call>
    {"name": "get_weather", "arguments": {"location": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. Models whose chat template renders ``tools``
itself (it mentions ``tools``) get their own template. For the others (SmolLM2's template has no
tool support) the generic template below is used:

- the tool list goes into the system message (appended to the caller's own system message, or a
  new first message): a short instruction, then one ``{"type": "function", "function": ...}``
  JSON line per tool inside ``<tools></tools>``;
- an assistant message's ``tool_calls`` are written after its content in the format above;
- a ``tool`` message becomes a ``user`` message ``<tool_response>\\n...\\n</tool_response>``
  (consecutive tool results are merged into one message, as Qwen's template does).

``tool_choice`` and the grammar:

- ``none``: tools are not rendered and nothing is parsed (the model answers in text);
- ``auto``: either free text that never contains ``<tool_call>``, or one or more calls (one, with
  ``parallel_tool_calls: false``); the model chooses with its first token;
- ``required``: one or more calls to any of the tools; a named function: exactly one call to it.

Every call's ``arguments`` is decoded under that function's ``parameters`` schema, so it always
validates (unless generation hits ``max_tokens``, and then ``finish_reason`` is ``length``).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from router.errors import BadRequestError
from router.openai.json_schema import close_objects
from tiers.grammar import GrammarSpec, json_options

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "Tool",
    "ToolCallStreamer",
    "ToolChoice",
    "call_id",
    "native_tool_template",
    "parse_tool_calls",
    "render_messages",
    "tool_grammar",
]

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

SYSTEM_TOOLS_TEMPLATE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool

    def as_json(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None


def parse_tools(raw: list[Any] | None, param: str = "tools") -> list[Tool]:
    """Validate the request's ``tools`` (OpenAI function tools; 400s name the offending path)."""
    tools: list[Tool] = []
    seen: set[str] = set()
    for i, item in enumerate(raw or []):
        where = f"{param}[{i}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise BadRequestError(
                f"'{where}.type' must be 'function' (got {kind!r}); only function tools are supported.",
                param=f"{where}.type",
                code="unsupported_value",
            )
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise BadRequestError(f"'{where}.function' is required.", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise BadRequestError(
                f"'{where}.function.name' must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}.",
                param=f"{where}.function.name",
            )
        if name in seen:
            raise BadRequestError(f"Duplicate tool name '{name}'.", param=f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise BadRequestError(
                f"'{where}.function.parameters' must be a JSON schema object.",
                param=f"{where}.function.parameters",
            )
        desc = fn.get("description")
        tools.append(Tool(name, desc if isinstance(desc, str) else None, params, bool(fn.get("strict"))))
    return tools


def parse_tool_choice(raw: Any, tools: list[Tool], param: str = "tool_choice") -> ToolChoice:
    """OpenAI's default is ``auto`` with tools and ``none`` without."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise BadRequestError(
                f"'{param}' must be 'none', 'auto', 'required' or a named function, got {raw!r}.",
                param=param,
            )
        if raw != "none" and not tools:
            raise BadRequestError(f"'{param}' is '{raw}' but no 'tools' were given.", param=param)
        return ToolChoice(raw)  # type: ignore[arg-type]
    if isinstance(raw, dict) and raw.get("type") == "function":
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise BadRequestError(f"'{param}.function.name' is required.", param=f"{param}.function.name")
        if name not in {t.name for t in tools}:
            raise BadRequestError(
                f"'{param}' names function '{name}', which is not in 'tools'.", param=f"{param}.function.name"
            )
        return ToolChoice("named", name)
    raise BadRequestError(
        f"'{param}' must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}.",
        param=param,
    )


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- prompt side -----------------------------------------------------------------------------------
def native_tool_template(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (and tool calls) itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template and "tool_calls" in template


def _call_text(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        # A string that is not JSON is kept as it is: the history is rendered, not validated.
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments) if arguments.strip() else {}
    return CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CALL_CLOSE


def render_messages(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, str]]:
    """The generic tool template: a conversation with tools, tool calls and tool results as plain
    ``{"role", "content"}`` messages any chat template renders. ``messages`` are OpenAI-shaped
    dicts (``content`` already flattened to text, optional ``tool_calls``)."""
    out: list[dict[str, str]] = []
    if tools:
        block = SYSTEM_TOOLS_TEMPLATE.format(
            tools="\n".join(json.dumps(t.as_json(), ensure_ascii=False) for t in tools)
        )
        first = messages[0] if messages else None
        if first is not None and first["role"] in ("system", "developer") and first.get("content"):
            out.append({"role": "system", "content": f"{first['content']}\n\n{block}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        role = m["role"]
        content = m.get("content") or ""
        if role == "developer":
            role = "system"
        if role == "assistant" and m.get("tool_calls"):
            calls = [
                _call_text(c["function"]["name"], c["function"].get("arguments", "{}"))
                for c in m["tool_calls"]
                if isinstance(c, dict) and isinstance(c.get("function"), dict)
            ]
            text = "\n".join([content, *calls]) if content else "\n".join(calls)
            out.append({"role": "assistant", "content": text})
        elif role in ("tool", "function"):
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response})
        else:
            out.append({"role": role, "content": content})
    return out


# -- grammar ---------------------------------------------------------------------------------------
def _lark_string(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid Lark string literal


def _args_schema(tool: Tool) -> str:
    schema = dict(close_objects(tool.parameters))
    # llguidance reads compile options from the schema itself inside a Lark grammar.
    schema["x-guidance"] = json_options(strict=tool.strict)
    return json.dumps(schema, separators=(",", ":"))


def tool_grammar(
    tools: list[Tool], choice: ToolChoice, *, parallel: bool, text: GrammarSpec | None = None
) -> GrammarSpec | None:
    """The grammar of the whole assistant output, or None when it is free (``none``).

    ``text``: the grammar of a plain answer under ``auto`` (e.g. a ``response_format`` schema);
    by default any text that does not contain the call marker."""
    if choice.mode == "none":
        return text
    chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    lines = []
    alts = []
    for i, tool in enumerate(chosen):
        head = _lark_string(CALL_OPEN + '{"name": ' + json.dumps(tool.name) + ', "arguments": ')
        lines.append(f"call_{i}: {head} args_{i} {_lark_string('}' + CALL_CLOSE)}")
        lines.append(f"args_{i}: %json {_args_schema(tool)}")
        alts.append(f"call_{i}")
    lines.append("call: " + " | ".join(alts))
    many = parallel and choice.mode != "named"
    lines.append('calls: call ("\\n" call)*' if many else "calls: call")
    if choice.mode == "auto":
        if text is not None and text.kind == "json_schema":
            opts = json.loads(text.source)
            opts["x-guidance"] = json_options(strict=text.strict)
            lines.append(f"answer: %json {json.dumps(opts, separators=(',', ':'))}")
        else:
            # Free text, as long as it never opens a call: the first token decides text or calls.
            lines.append(r"answer: ANSWER")
            lines.append(r"ANSWER: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/")
        lines.insert(0, "start: answer | calls")
    else:
        lines.insert(0, "start: calls")
    return GrammarSpec.lark("\n".join(lines))


# -- output side -----------------------------------------------------------------------------------
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
