"""`specdec serve`: an OpenAI-compatible HTTP server over the speculative engine.

    protocol.py       OpenAI request/response models (pydantic) and the error shape
    tool_calls.py     tool calls in the model's text: parsed whole, or while it streams
    anthropic.py      Anthropic's Messages API (/v1/messages) translated to and from chat requests
    responses.py      OpenAI's Responses API (/v1/responses) likewise, and the store of responses
    async_engine.py   the engine's worker thread and its asyncio bridge (abort on disconnect)
    app.py            the FastAPI app: routes, SSE streaming, auth, body limit
    limits.py         deadlines for reading a request (head, body) and the limit on requests in flight
    metrics.py        Prometheus metrics with vLLM's names under `specdec:`
    cli.py            `add_serve_arguments` / `run_serve`: the command line
    replicas.py       `serve --replicas N`: engine replicas as Ray Serve deployments behind an ingress
    routing.py        cache-aware routing: a prompt's prefix-cache block keys, the replica holding most of them
    forwarding.py     a request carried to a replica and answered there by its own app (ASGI in memory)
    metrics_merge.py  the replicas' Prometheus metrics summed into one server's
"""

DEFAULT_CHAT_MAX_TOKENS = 1024  # a chat request without max_tokens (vLLM: the rest of the context; bounded here)
DEFAULT_TIMEOUT_HEADERS = 10.0  # seconds for a request's head (see limits.py)
DEFAULT_TIMEOUT_BODY = 60.0  # seconds for its body after the head (4 MiB at 70 KB/s)
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0  # seconds an idle connection is kept between requests (uvicorn's default)

__all__ = ["AsyncEngine", "build_app"]


def __getattr__(name: str):
    """`build_app` and `AsyncEngine` imported on first use, so that `specdec generate` (whose parser holds
    the serve flags) does not import FastAPI, uvicorn and pydantic: about a second of its start."""
    if name == "build_app":
        from specdec.server.app import build_app
        return build_app
    if name == "AsyncEngine":
        from specdec.server.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(f"module 'specdec.server' has no attribute {name!r}")
