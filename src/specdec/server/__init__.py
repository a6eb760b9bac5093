"""`specdec serve`: an OpenAI-compatible HTTP server over the speculative engine.

    protocol.py       OpenAI request/response models (pydantic) and the error shape
    tool_calls.py     tool calls in the model's text: parsed whole, or while it streams
    async_engine.py   the engine's worker thread and its asyncio bridge (abort on disconnect)
    app.py            the FastAPI app: routes, SSE streaming, auth, body limit
    metrics.py        Prometheus metrics with vLLM's names under `specdec:`
    cli.py            `add_serve_arguments` / `run_serve`: the command line
"""

from specdec.server.app import build_app
from specdec.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app"]
