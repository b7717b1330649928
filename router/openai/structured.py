"""What a request asks of its output beyond plain text, compiled from the validated body in one
pass: a response format, tools (how they reach the prompt and the grammar a call is decoded
under), logprobs, several choices. ``compile_chat`` / ``compile_completion`` build the
``OutputSpec`` (and, for chat, the conversation as plain messages); the local backend turns the
spec into engine parameters (a grammar constraint per choice, logprobs, n), and the response writer
shapes the answer with it (tool calls, logprobs objects, choices; ``router.openai.tools`` reads
calls back out of the output).

Tool calls use the Hermes/Qwen2.5 format, which instruction-tuned models have seen most:

    <tool_call>
    {"name": "get_weather", "arguments": {"location": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. Models whose chat template renders ``tools``
itself get their own template (``router.backends.local``). For the others (SmolLM2's template has
no tool support) the generic template here is used:

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

Policy rules can route on the spec: ``has_tools`` and ``response_format`` ("text" |
"json_object" | "json_schema").
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from router.errors import BadRequestError
from router.openai.json_schema import check_strict_schema, close_objects
from router.openai.schemas import ChatCompletionRequest, CompletionRequest, ContentPart
from tiers.sample.grammar import GrammarSpec, json_options

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "OutputSpec",
    "Tool",
    "ToolChoice",
    "chat_messages",
    "compile_chat",
    "compile_completion",
    "content_text",
    "output_spec",
    "parse_tool_choice",
    "parse_tools",
    "raw_messages",
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


@dataclass(slots=True)
class OutputSpec:
    n: int = 1
    """Choices returned."""
    best_of: int = 1
    """Choices generated (completions ``best_of``): the ``n`` with the highest mean logprob win."""
    logprobs: int | None = None
    """None: no logprobs; k: each token's logprob and k alternatives."""
    echo: bool = False
    response_format: str = "text"
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True
    grammar: GrammarSpec | None = None
    """The grammar every choice is decoded under (None: unconstrained)."""
    grammar_param: str | None = None
    """The request field a grammar compile error is blamed on."""
    has_tools: bool = field(init=False)
    """The request offers tools (set from ``tools`` when the spec is built)."""
    parses_tool_calls: bool = field(init=False)
    """Tools are offered and may be called (``tool_choice`` is not ``none``): the output is
    decoded under the tool grammar and read back as calls."""

    def __post_init__(self) -> None:
        self.has_tools = bool(self.tools)
        self.parses_tool_calls = self.has_tools and self.tool_choice.mode != "none"

    @property
    def is_plain(self) -> bool:
        """One text choice, no logprobs: the shape the response cache stores and replays."""
        return self.n == 1 and self.best_of == 1 and self.logprobs is None and not self.parses_tool_calls


def _format_grammar(req: ChatCompletionRequest) -> tuple[str, GrammarSpec | None]:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return "text", None
    if rf.type == "json_object":
        return "json_object", GrammarSpec.json_object()
    assert rf.json_schema is not None  # validate_chat checked both
    assert rf.json_schema.schema is not None
    strict = bool(rf.json_schema.strict)
    if strict:
        check_strict_schema(rf.json_schema.schema, rf.json_schema.name)
    return "json_schema", GrammarSpec.json_schema(close_objects(rf.json_schema.schema), strict=strict)


def output_spec(req: ChatCompletionRequest | CompletionRequest) -> OutputSpec:
    """The output contract of a validated request (``validate_chat`` / ``validate_completion``):
    the response format's grammar, the tools and the choice among them, and the grammar of the
    whole answer when tools may be called."""
    n = req.n or 1
    if isinstance(req, CompletionRequest):
        return OutputSpec(n=n, best_of=req.best_of or n, logprobs=req.logprobs, echo=bool(req.echo))
    fmt, grammar = _format_grammar(req)
    tools = parse_tools(req.tools)
    choice = parse_tool_choice(req.tool_choice, tools)
    parallel = req.parallel_tool_calls is not False
    spec = OutputSpec(
        n=n,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        response_format=fmt,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        grammar=grammar,
        grammar_param="response_format" if grammar is not None else None,
    )
    if spec.parses_tool_calls:
        spec.grammar = tool_grammar(tools, choice, parallel=parallel, text=grammar)
        spec.grammar_param = "tools"
    return spec


def compile_chat(req: ChatCompletionRequest) -> tuple[OutputSpec, list[dict[str, Any]], list[dict[str, str]]]:
    """A validated chat request's output contract and conversation, in one pass: ``(spec, raw,
    messages)`` - ``raw`` the messages as OpenAI-shaped dicts (content flattened to text, tool
    calls kept: what a model's own tool template renders), ``messages`` the same as plain
    ``{"role", "content"}`` messages under the generic tool template (what the classifier
    scores, the cache keys and templates without tool support render)."""
    spec = output_spec(req)
    raw = raw_messages(req)
    return spec, raw, render_messages(raw, spec.tools if spec.tool_choice.mode != "none" else [])


def compile_completion(req: CompletionRequest) -> OutputSpec:
    """A validated completion request's output contract (choices, ``best_of``, logprobs, echo)."""
    return output_spec(req)


def content_text(content: str | list[ContentPart] | None) -> str:
    """One message's content as text: its text parts joined (what the routing score reads of a
    whole conversation is ``classifier.inference.message_text``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content if p.type in ("text", "input_text"))


def raw_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as OpenAI-shaped dicts: content flattened to text, ``tool_calls``,
    ``tool_call_id`` and ``name`` kept where given."""
    out: list[dict[str, Any]] = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": m.role, "content": content_text(m.content)}
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def chat_messages(req: ChatCompletionRequest, spec: OutputSpec) -> list[dict[str, str]]:
    """The conversation as plain ``{"role", "content"}`` messages (``compile_chat``'s third
    part). Tools are left out under ``tool_choice: none``."""
    return render_messages(raw_messages(req), spec.tools if spec.tool_choice.mode != "none" else [])


# -- prompt side -----------------------------------------------------------------------------------
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
    responses: list[str] = []  # a run of tool results: one user turn, joined once (linear)

    def flush() -> None:
        if responses:
            out.append({"role": "user", "content": "\n".join(responses)})
            responses.clear()

    for m in messages:
        role = m["role"]
        content = m.get("content") or ""
        if role in ("tool", "function"):
            responses.append(f"<tool_response>\n{content}\n</tool_response>")
            continue
        flush()
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
        else:
            out.append({"role": role, "content": content})
    flush()
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
