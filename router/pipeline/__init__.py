"""One request through the service: admission, tenant limits, the response cache, routing,
generation on a backend, shadow and feedback."""
