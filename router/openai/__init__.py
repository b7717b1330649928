"""The OpenAI wire format: request and response types, what a request asks of its output
(response format, tools, logprobs, n), and the writers of JSON and SSE answers."""
