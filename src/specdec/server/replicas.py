"""Engine replicas on Ray Serve: `specdec serve --replicas N`, or `serve run specdec.deploy:app` on a cluster.

    client -> Ray Serve's HTTP proxy -> Ingress (no model: the tokenizer, for the routing keys)
                                           -> EngineReplica 0 .. N-1 (each the whole single-process app)
              EngineReplica i -> Board (each replica posts its health and Prometheus metrics every second)

The ingress reads a request's body, computes its prompt's block keys (`specdec.server.routing`) and forwards
it (`specdec.server.forwarding`) through a Ray Serve handle whose request router is `BlockAffinityRouter`
(`--routing affinity`, the default) or Ray Serve's own power-of-two-choices router (`--routing default`). A
replica answers with `build_app`'s app, so routes, errors and streams are those of `specdec serve`.
/health is 200 when all N replicas posted within `FRESH_S` seconds that their engine runs; /metrics is the
sum of the fresh replicas' metrics; /replicas lists them. Ray Serve restarts a replica whose process dies
or whose `check_health` fails; requests it had taken fail (503 `replica_failed`), the others go on, and
requests not yet sent to a replica wait in the ingress's router for a live one.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import threading
import time
from dataclasses import dataclass

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specdec.server.forwarding import ForwardedRequest, ReplayedResponse, call_app, replica_failed
from specdec.server.metrics import CONTENT_TYPE
from specdec.server.metrics_merge import merge_metrics
from specdec.server.routing import KeyOwners, PromptKeys, RouteHint, choose

FRESH_S = 3.0  # a replica whose last report is older is not counted healthy
REPORT_EVERY_S = 1.0
ROUTINGS = ("affinity", "default")
HTTP_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica and the ingress are built from: the `specdec serve` flags (parsed once), and the
    module providing `load_engine(args) -> (engine, served names, build_app options)` and
    `load_tokenizer(args)` (`specdec.server.cli` for real models; `specdec.testing.tiny_server` in tests)."""

    args: argparse.Namespace
    loader: str = "specdec.server.cli"

    def load(self):
        return importlib.import_module(self.loader)


@dataclass(frozen=True)
class Report:
    replica: str  # Ray Serve's replica id
    rank: int
    pid: int
    healthy: bool
    metrics: bytes


# ---- the router ----------------------------------------------------------------------------------------


class BlockAffinityRouter(RequestRouter):
    """Ray Serve request router for `--routing affinity` (`specdec.server.routing.choose`), learning which
    replica holds which blocks as it routes. Reads the `RouteHint` passed first in the handle call."""

    def initialize_state(self, imbalance: int = 2) -> None:
        self.imbalance = imbalance
        self.owners = KeyOwners()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        lens = {rid: self.replica_queue_len_cache.get(r.replica_id) for rid, r in by_id.items()}
        hint = _hint(pending_request)
        return [[by_id[rid] for rid in rank]
                for rank in choose(hint.keys, self.owners, lens, self.imbalance, stored_by=hint.stored_by)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.owners.record(_hint(pending_request).keys, replica_id.unique_id)


def _hint(pending_request: PendingRequest | None) -> RouteHint:
    args = pending_request.args if pending_request is not None else ()
    return args[0] if args and isinstance(args[0], RouteHint) else RouteHint()


# ---- the deployments -----------------------------------------------------------------------------------


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=2, health_check_timeout_s=10)
class EngineReplica:
    """One engine and its single-process app; posts a `Report` to the board every `REPORT_EVERY_S`."""

    def __init__(self, spec: ReplicaSpec, board) -> None:
        import torch

        from specdec.server.app import build_app
        from specdec.server.async_engine import AsyncEngine
        from specdec.server.metrics import ServerMetrics
        from specdec.server.responses import ResponseStore

        torch.set_num_threads(spec.args.replica_threads)
        context = serve.get_replica_context()
        engine, names, options = spec.load().load_engine(spec.args)
        self.engine = AsyncEngine(engine, max_waiting_requests=spec.args.max_waiting_requests)
        self.metrics = ServerMetrics(names[0])
        # its ids name this replica (for the router); the file, if any, is shared by the replicas of the machine
        store = ResponseStore(owner=context.replica_id.unique_id, path=options.pop("responses_db", None),
                              retention_s=options.pop("responses_retention_s", None))
        self.app = build_app(self.engine, names, metrics=self.metrics, response_store=store, **options)
        self.engine.start()
        self.identity = (context.replica_id.unique_id, context.rank.rank if context.rank else -1, os.getpid())
        self.board, self.stopped = board, threading.Event()
        threading.Thread(target=self._report_loop, name="specdec-report", daemon=True).start()

    async def forward(self, hint: RouteHint, request: ForwardedRequest):
        """The app's ASGI messages answering `request`; the status line names this replica's rank in an
        `x-specdec-replica` header."""
        async for message in call_app(self.app, request):
            if message["type"] == "http.response.start":
                rank = str(self.identity[1]).encode()
                message = {**message, "headers": [*message.get("headers", []), (b"x-specdec-replica", rank)]}
            yield message

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError("the engine thread is not running")

    def _report_loop(self) -> None:
        while not self.stopped.wait(REPORT_EVERY_S):
            try:
                self.board.post.remote(Report(*self.identity, self.engine.healthy, self.metrics.render())).result()
            except Exception:  # the board restarting: the next report goes through
                continue

    def __del__(self) -> None:
        self.stopped.set()
        self.engine.shutdown(timeout=5)


@serve.deployment(ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False})
class Board:
    """The replicas' latest reports, with when each came."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, Report]] = {}

    def post(self, report: Report) -> None:
        self.reports[report.replica] = (time.monotonic(), report)

    def fresh(self) -> list[Report]:
        now = time.monotonic()
        self.reports = {k: (t, r) for k, (t, r) in self.reports.items() if now - t < 60}
        return sorted((r for t, r in self.reports.values() if now - t < FRESH_S), key=lambda r: r.rank)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    """The HTTP entry: its own /health, /metrics and /replicas; every other request forwarded to a replica."""

    def __init__(self, spec: ReplicaSpec, engine, board) -> None:
        args = spec.args
        self.replicas, self.engine, self.board = args.replicas, engine.options(stream=True), board
        self.keys = PromptKeys(spec.load().load_tokenizer(args), args.special_tokens_in_messages) \
            if args.routing == "affinity" else None
        self.api_key, self.public_metrics = args.api_key, args.public_metrics

    def __serve_build_asgi_app__(self) -> Starlette:
        from specdec.server.middleware import ApiKeyAuth

        app = Starlette(routes=[Route("/health", self.health), Route("/metrics", self.prometheus),
                                Route("/replicas", self.list_replicas),
                                Route("/{path:path}", self.forward, methods=HTTP_METHODS)])
        if not self.api_key:
            return app
        open_paths = {"/health", "/metrics"} if self.public_metrics else {"/health"}
        return ApiKeyAuth(app, self.api_key, frozenset(open_paths))

    async def health(self, request: Request) -> Response:
        reports = await self.board.fresh.remote()
        healthy = sum(r.healthy for r in reports)
        if healthy >= self.replicas:
            return Response(status_code=200)
        return JSONResponse({"error": {"message": f"{healthy} of {self.replicas} engine replicas are healthy",
                                       "type": "server_error", "param": None, "code": "engine_unavailable"}},
                            status_code=503)

    async def prometheus(self, request: Request) -> Response:
        reports = await self.board.fresh.remote()
        return Response(merge_metrics([r.metrics for r in reports]), media_type=CONTENT_TYPE)

    async def list_replicas(self, request: Request) -> Response:
        reports = await self.board.fresh.remote()
        return JSONResponse({"expected": self.replicas, "replicas": [
            {"replica": r.replica, "rank": r.rank, "pid": r.pid, "healthy": r.healthy} for r in reports]})

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        forwarded = ForwardedRequest.of(request.scope, body)
        hint = await asyncio.to_thread(self.keys.of, forwarded.path, body) if self.keys else RouteHint()
        stream = self.engine.forward.remote(hint, forwarded)
        try:
            start = await stream.__anext__()
        except Exception:
            return replica_failed().response()
        return ReplayedResponse(start, stream)


def build_application(spec: ReplicaSpec):
    """The Ray Serve application: the ingress, `spec.args.replicas` engine replicas, the board."""
    args = spec.args
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.routing not in ROUTINGS:
        raise ValueError(f"--routing must be one of {', '.join(ROUTINGS)}, got {args.routing!r}")
    max_ongoing = args.replica_max_ongoing_requests or 2 * args.max_num_seqs
    options = dict(num_replicas=args.replicas, max_ongoing_requests=max_ongoing,
                   max_queued_requests=args.max_waiting_requests * args.replicas,
                   ray_actor_options={"num_cpus": args.replica_threads},
                   graceful_shutdown_timeout_s=args.shutdown_timeout)
    if args.routing == "affinity":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=BlockAffinityRouter,
            request_router_kwargs={"imbalance": max(1, args.max_num_seqs // 2)})
    board = Board.bind()
    return Ingress.bind(spec, EngineReplica.options(**options).bind(spec, board), board)


def serve_replicas(spec: ReplicaSpec) -> int:
    """`specdec serve --replicas N`: the application on Ray Serve at --host:--port, until SIGINT or SIGTERM.
    A local Ray is started with enough CPUs for the replicas, unless RAY_ADDRESS names a cluster to join."""
    import signal

    import ray

    args = spec.args
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, args.replicas * args.replica_threads), include_dashboard=False)
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port,
                                  "keep_alive_timeout_s": int(args.timeout_keep_alive)})
        serve.run(build_application(spec), name="specdec", route_prefix="/")
        print(f"specdec serve: {args.replicas} engine replica(s) of {args.model or 'the default target'} on Ray "
              f"Serve, routing {args.routing}; OpenAI API at http://{args.host}:{args.port}/v1", flush=True)
        stop.wait()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        serve.shutdown()
        ray.shutdown()
    return 0
