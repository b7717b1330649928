"""The one writer of OpenAI answers: engine outputs in, one JSON body or an SSE stream out.
``answer`` drives one answer; ``choices``, ``merge`` and ``sse`` are its parts. Imports only
``router.openai``'s leaves, ``router.errors`` and ``tiers.core``."""

from router.openai.writer.answer import (
    NOTHING_SERVED,
    RETRY_AFTER_S,
    InFlight,
    OnComplete,
    ResponseWriter,
    Served,
    first_within,
    remote_error,
)
from router.openai.writer.choices import ChoiceBuilder, aggregate
from router.openai.writer.merge import Merged
from router.openai.writer.sse import (
    DONE,
    ERROR_PREFIX,
    SSEStream,
    completion_body,
    now,
    replay,
    sse_event,
    usage_body,
)

__all__ = [
    "DONE",
    "ERROR_PREFIX",
    "NOTHING_SERVED",
    "RETRY_AFTER_S",
    "ChoiceBuilder",
    "InFlight",
    "Merged",
    "OnComplete",
    "ResponseWriter",
    "SSEStream",
    "Served",
    "aggregate",
    "completion_body",
    "first_within",
    "now",
    "remote_error",
    "replay",
    "sse_event",
    "usage_body",
]
