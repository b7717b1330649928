"""The HTTP side: the litestar app and its lifespan, the route handlers (OpenAI, Responses,
Anthropic Messages), middleware, auth, the uvicorn server, the admin listener, policy reload."""
