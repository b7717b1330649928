"""A tier served in-process by an ``Engine`` (``LocalTier``, a ``Backend``), and a request for
it: its prompt ids (the tier's chat template, or a model's own tool template when it renders
tools itself), one ``SamplingParams`` per choice (each with its own grammar matcher and seed), and
the submission to the tier's engine, with the engine's refusals turned into OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from router.backends.base import Prepared, engine_key
from router.errors import BadRequestError, OverloadedError
from router.openai.logprobs import token_texts
from router.openai.request import Generation
from router.openai.writer import NOTHING_SERVED, RETRY_AFTER_S, Served
from tiers.core.output import StepOutput
from tiers.core.sequence import SamplingParams
from tiers.engine.llm_engine import Engine, EngineFullError, EngineLoad

if TYPE_CHECKING:
    from router.openai.structured import OutputSpec
    from router.policy.schema import TierConfig

__all__ = [
    "LocalTier",
    "choice_params",
    "local_stream",
    "native_prompt_ids",
    "native_tool_template",
    "prepare_local",
    "prepare_local_async",
    "sampling_params",
    "submit_local",
    "system_fingerprint",
]


class LocalTier:
    """A tier served in-process by an ``Engine``."""

    is_remote = False

    def __init__(self, name: str, cfg: TierConfig, engine: Engine, draft_of: str | None) -> None:
        self.name = name
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.draft_tier = draft_of
        self.key = engine_key(cfg)
        self.retired = False
        """Set by a reload that replaced this tier: nothing new may be submitted to it."""
        self._served = Served(system_fingerprint(name, self.key), token_texts(self.tokenizer))
        """What the writer is told of this tier: the same for every request it answers."""

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_model_len

    def is_full(self) -> bool:
        return self.engine.load().is_full

    def prompt_ids(
        self,
        kind: str,
        messages: list[dict[str, str]] | None,
        prompt: str | None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if kind == "chat":
            assert messages is not None
            return chat_prompt_ids(self.tokenizer, messages, template_kwargs)
        assert prompt is not None
        return list(self.tokenizer.encode(prompt)) or [self.tokenizer.eos_token_id or 0]

    def clamp_max_tokens(self, num_prompt: int, requested: int | None, param: str) -> int:
        """OpenAI semantics: a prompt that cannot fit is a 400; ``max_tokens`` is clamped to the room left."""
        room = self.max_model_len - num_prompt
        if room < 1:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"is {num_prompt} tokens (tier '{self.name}').",
                param="messages" if param == "max_completion_tokens" else "prompt",
                code="context_length_exceeded",
            )
        wanted = requested if requested is not None else self.cfg.defaults.max_tokens
        return max(1, min(wanted, room))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        handle = self.engine.submit(prompt_ids, params)
        async for out in handle:
            yield out

    # -- the Backend protocol --------------------------------------------------------------
    def load(self) -> EngineLoad:
        return self.engine.load()

    def shadow_load(self) -> EngineLoad:
        return self.engine.load()

    async def prepare(self, gen: Generation, prompt_tokens: int, *, grammar_timeout_s: float) -> Prepared:
        ids, params = await prepare_local_async(self, gen, grammar_timeout_s=grammar_timeout_s)
        return Prepared((ids, params), len(ids), self.served(gen))

    def served(self, gen: Generation) -> Served:
        return self._served if gen.output is not None else NOTHING_SERVED

    def submit(self, gen: Generation, prepared: Prepared) -> list[AsyncIterator[StepOutput]]:
        ids, params = prepared.payload
        return submit_local(self, gen, ids, params)

    def stream(self, gen: Generation) -> AsyncIterator[StepOutput]:
        return local_stream(self, gen)[0][0]

    async def aclose(self) -> None:
        """The engine belongs to the tier set's device worker, which stops it."""


def system_fingerprint(tier: str, key: Any) -> str:
    """OpenAI's ``system_fingerprint``: changes exactly when the serving configuration of the tier
    (model, quantization, engine settings) does, so clients can tell answers of different setups."""
    return "fp_" + hashlib.sha256(repr((tier, key)).encode()).hexdigest()[:10]


def native_tool_template(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (and tool calls) itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template and "tool_calls" in template


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """A conversation's prompt ids under the tokenizer's chat template (``template_kwargs``:
    ``Generation.template_kwargs``), or a plain ``role: content`` rendering without one."""
    options = {"add_generation_prompt": True, **(template_kwargs or {})}
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, tokenize=True, **options)
        return list(out["input_ids"] if isinstance(out, Mapping) else out)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    if options.get("continue_final_message"):
        text = text.removesuffix("\n")
    elif options["add_generation_prompt"]:
        text += "assistant: "
    return list(tokenizer.encode(text))


def native_prompt_ids(tokenizer: Any, gen: Generation) -> list[int] | None:
    """Prompt ids through the model's own chat template when it renders tools itself; None when
    the generic rendering applies (no tools, or a template without tool support)."""
    spec, raw = gen.output, gen.raw_messages
    if spec is None or raw is None:
        return None
    if not spec.parses_tool_calls and not any(m.get("tool_calls") or m["role"] == "tool" for m in raw):
        return None
    if not native_tool_template(tokenizer):
        return None
    tools = [t.as_json() for t in spec.tools] if spec.tool_choice.mode != "none" else None
    messages = [dict(m) for m in raw]  # the request's own stay as they are: a retry renders them again
    for m in messages:  # templates expect arguments as objects (Qwen2.5, Llama 3.1 do)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": dict(c["function"])} for c in m["tool_calls"]]
            for c in m["tool_calls"]:
                with contextlib.suppress(ValueError):
                    c["function"]["arguments"] = json.loads(c["function"]["arguments"] or "{}")
    options = {"add_generation_prompt": True, **gen.template_kwargs}
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, **options)
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return list(ids)


def sampling_params(backend: LocalTier, gen: Generation, num_prompt: int) -> SamplingParams:
    """The request's sampling fields over the tier's defaults, ``max_tokens`` clamped to its context."""
    s = gen.sampling
    defaults = backend.cfg.defaults
    max_tokens = backend.clamp_max_tokens(num_prompt, s.max_tokens, s.max_tokens_param)
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(s.min_tokens, max_tokens),  # the context's room bounds both
        temperature=defaults.temperature if s.temperature is None else s.temperature,
        top_p=defaults.top_p if s.top_p is None else s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop=s.stop,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        ignore_eos=s.ignore_eos,
        stop_token_ids=_stop_token_ids(backend, s.stop_token_ids),
        include_stop_str_in_output=s.include_stop_str_in_output,
        min_p=s.min_p,
        logit_bias=_logit_bias(backend, s.logit_bias),
        logprobs=_logprobs(gen),
    )


def _stop_token_ids(backend: LocalTier, ids: tuple[int, ...]) -> tuple[int, ...]:
    vocab = len(backend.tokenizer)
    for token in ids:
        if token >= vocab:
            raise BadRequestError(
                f"'stop_token_ids' names token {token}; tier '{backend.name}' has {vocab} tokens.",
                param="stop_token_ids",
            )
    return ids


def _logit_bias(backend: LocalTier, bias: Mapping[str, float] | None) -> tuple[tuple[int, float], ...]:
    vocab = len(backend.tokenizer)
    pairs = tuple((int(k), float(v)) for k, v in (bias or {}).items())
    for token, _ in pairs:
        if token >= vocab:
            raise BadRequestError(
                f"'logit_bias' names token {token}; tier '{backend.name}' has {vocab} tokens.",
                param="logit_bias",
            )
    return pairs


def _logprobs(gen: Generation) -> int | None:
    spec = gen.output
    if spec is None:
        return None
    if spec.best_of > spec.n:  # choices are ranked by their logprobs
        return spec.logprobs or 0
    return spec.logprobs


def choice_params(backend: LocalTier, gen: Generation, base: SamplingParams) -> list[SamplingParams]:
    """One ``SamplingParams`` per generated choice: each its own grammar matcher, and with a
    ``seed``, its own seed (choice i uses seed + i), so choices differ but replay exactly."""
    from tiers.sample.grammar import GrammarError, compiler_for

    spec = gen.output
    count = max(spec.n, spec.best_of) if spec is not None else 1
    params = []
    for i in range(count):
        constraint = None
        if spec is not None and spec.grammar is not None:
            try:
                constraint = compiler_for(backend.tokenizer).constraint(spec.grammar)
            except GrammarError as exc:
                raise _unenforceable(spec, exc) from exc
        seed = base.seed + i if base.seed is not None and i else base.seed
        params.append(dataclasses.replace(base, constraint=constraint, seed=seed))
    if spec is not None and spec.echo and spec.logprobs is not None:  # one choice (validate_completion)
        params[0] = dataclasses.replace(params[0], prompt_logprobs=spec.logprobs)
    return params


def prepare_local(backend: LocalTier, gen: Generation) -> tuple[list[int], list[SamplingParams]]:
    """Tokenize (the tier's chat template, or the structured-output spec's native prompt) and
    build each choice's sampling parameters (grammar matchers included). Work that grows with the
    request (a 1 MB prompt, a large schema): ``local_stream_async`` runs it off the event loop."""
    if gen.prompt_ids is not None and max(gen.prompt_ids) >= len(backend.tokenizer):
        raise BadRequestError(
            f"'prompt' names token {max(gen.prompt_ids)}; "
            f"tier '{backend.name}' has {len(backend.tokenizer)} tokens.",
            param="prompt",
        )
    try:
        native = native_prompt_ids(backend.tokenizer, gen) if gen.kind == "chat" else gen.prompt_ids
        ids = (
            native
            if native is not None
            else backend.prompt_ids(gen.kind, gen.messages, gen.prompt, gen.template_kwargs)
        )
    except TemplateError as exc:  # e.g. a template that demands alternating roles
        raise BadRequestError(
            f"The messages do not fit the chat template of tier '{backend.name}': {exc}",
            param="messages",
            code="invalid_messages",
        ) from exc
    params = choice_params(backend, gen, sampling_params(backend, gen, len(ids)))
    return ids, params


def submit_local(
    backend: LocalTier, gen: Generation, ids: list[int], params: list[SamplingParams]
) -> list[AsyncIterator[StepOutput]]:
    """Submit a prepared request to the tier's engine (on the event loop): one stream per choice."""
    # The caller's partition names the prefix-cache salt: one tenant's (or tenant-less key's)
    # prompts never warm, or time, another's cached KV. Anonymous callers share the unsalted cache.
    partition = gen.ctx.partition if gen.ctx is not None else "-"
    salt = "" if partition == "-" else partition
    # Fair sharing of batch slots between callers (tiers/core/sched/scheduler.py): a flood cannot starve
    # a trickle, and each caller's requests keep their order.
    caller = (gen.ctx.principal or "") if gen.ctx is not None else ""
    try:
        if len(params) == 1:
            handles = [backend.engine.submit(ids, params[0], cache_salt=salt, caller=caller)]
        else:
            handles = backend.engine.submit_n(ids, params, cache_salt=salt, caller=caller)
    except EngineFullError as exc:
        raise OverloadedError(
            f"Tier '{backend.name}' is at capacity; retry shortly.", retry_after=RETRY_AFTER_S
        ) from exc
    except ValueError as exc:
        raise BadRequestError(
            str(exc), param="messages" if gen.kind == "chat" else "prompt", code="context_length_exceeded"
        ) from exc
    return [h.__aiter__() for h in handles]


def local_stream(backend: LocalTier, gen: Generation) -> tuple[list[AsyncIterator[StepOutput]], int]:
    """``prepare_local`` then ``submit_local``, inline: one output stream per choice and the
    prompt's token count. For requests already bounded (shadow answers of served requests)."""
    ids, params = prepare_local(backend, gen)
    return submit_local(backend, gen, ids, params), len(ids)


_GRAMMAR_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
"""Grammar compilations run here, two at a time: a flood of fresh schemas queues behind itself,
not behind (or in front of) every other request's tokenization in the loop's default executor."""


async def prepare_local_async(
    backend: LocalTier, gen: Generation, *, grammar_timeout_s: float
) -> tuple[list[int], list[SamplingParams]]:
    """``prepare_local`` off the event loop: the grammar compiled in ``_GRAMMAR_POOL`` within
    ``grammar_timeout_s`` (cached by the schema's hash, so the matchers ``prepare_local`` builds
    are copies), tokenization in a worker thread; the caller submits (``submit_local``) on the
    loop. A compilation past its budget is a 400 (it finishes in the background and is cached, so
    a retry of the same schema is fast)."""
    from tiers.sample.grammar import GrammarError, compiler_for

    spec = gen.output
    if spec is not None and spec.grammar is not None:
        compiler = compiler_for(backend.tokenizer)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(
                loop.run_in_executor(_GRAMMAR_POOL, compiler.validate, spec.grammar), grammar_timeout_s
            )
        except TimeoutError:
            raise BadRequestError(
                f"The {spec.grammar_param} schema took longer than {grammar_timeout_s:g} s to compile "
                "(service.limits.grammar_timeout_s); simplify it.",
                param=spec.grammar_param,
                code="limit_exceeded",
            ) from None
        except GrammarError as exc:
            raise _unenforceable(spec, exc) from exc
    return await asyncio.to_thread(prepare_local, backend, gen)


def _unenforceable(spec: OutputSpec, exc: Exception) -> BadRequestError:
    return BadRequestError(
        f"The {spec.grammar_param} schema cannot be enforced: {exc}",
        param=spec.grammar_param,
        code="invalid_schema",
    )
