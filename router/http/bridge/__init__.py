"""The APIs answered through the chat pipeline: OpenAI's Responses and Anthropic's Messages, each a
request translated into a chat completion and its answer translated back (``chat`` is what they
share). Imports ``router.http.routes`` and the layers below ``router.http``."""
