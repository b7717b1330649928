"""What a request asks of its output beyond plain text: a response format, tools, logprobs,
several choices. ``OutputSpec`` is built once per request from the validated body; the service
turns it into engine parameters (a grammar constraint per choice, logprobs, n) for local tiers,
and the response writer uses it to shape the answer (tool calls, logprobs objects, choices).

Policy rules can route on it: ``Generation.output.has_tools`` and
``Generation.output.response_format`` ("text" | "json_object" | "json_schema").
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from router.openai.json_schema import check_strict_schema, close_objects
from router.openai.schemas import ChatCompletionRequest, CompletionRequest, content_text
from router.openai.tools import Tool, ToolChoice, parse_tool_choice, parse_tools, tool_grammar
from tiers.grammar import GrammarSpec

__all__ = ["OutputSpec", "output_spec"]


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

    @property
    def has_tools(self) -> bool:
        return bool(self.tools)

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"

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
    """The output contract of a validated request (``validate_chat`` / ``validate_completion``)."""
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


def _raw_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
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
    """The conversation as plain ``{"role", "content"}`` messages (the generic tool template of
    ``router/openai/tools.py``): what the classifier scores, the cache keys and templates without tool
    support render. Tools are left out under ``tool_choice: none``."""
    from router.openai.tools import render_messages

    tools = spec.tools if spec.tool_choice.mode != "none" else []
    return render_messages(_raw_messages(req), tools)


def native_prompt_ids(tokenizer: Any, req: ChatCompletionRequest, spec: OutputSpec) -> list[int] | None:
    """Prompt ids through the model's own chat template when it renders tools itself; None when
    the generic rendering applies (no tools, or a template without tool support)."""
    from collections.abc import Mapping

    from router.openai.tools import native_tool_template

    if not spec.parses_tool_calls and not any(m.tool_calls or m.role == "tool" for m in req.messages):
        return None
    if not native_tool_template(tokenizer):
        return None
    tools = [t.as_json() for t in spec.tools] if spec.tool_choice.mode != "none" else None
    messages = _raw_messages(req)
    for m in messages:  # templates expect arguments as objects (Qwen2.5, Llama 3.1 do)
        for c in m.get("tool_calls") or []:
            with contextlib.suppress(ValueError):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"] or "{}")
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return list(ids)
