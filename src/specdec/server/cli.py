"""`specdec serve`: flags named as vLLM's, so that switching is a change of program name.

    specdec serve                                       # the default target, auto speculation, pulled first if needed
    specdec serve qwen2.5-coder-1.5b-instruct --speculative-model qwen2.5-coder-0.5b-instruct \\
        --num-speculative-tokens 5 --port 8000 --api-key sk-local
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from specdec.llm_args import add_llm_arguments, build_llm, positive_int
from specdec.server import (
    DEFAULT_CHAT_MAX_TOKENS, DEFAULT_TIMEOUT_BODY, DEFAULT_TIMEOUT_HEADERS, DEFAULT_TIMEOUT_KEEP_ALIVE,
)

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
# bounded by default, for a CPU deployment: requests queued for a batch slot, and requests being answered
# (open connections cost none: see specdec.server.limits)
DEFAULT_MAX_WAITING_REQUESTS, DEFAULT_LIMIT_CONCURRENCY = 64, 256
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds requests in flight get to finish after SIGTERM
DEFAULT_ENGINE_NICE = 5  # the engine's threads run this much nicer than the HTTP server's (`lower_priority`)


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", nargs="?", default=None, metavar="TARGET",
                        help="target model: a known name, a model folder or a .gguf file "
                             "(default: qwen2.5-coder-1.5b-instruct, with auto speculation: suffix drafts and the "
                             "Medusa heads shipped for it)")
    parser.add_argument("--max-num-seqs", type=int, default=8, metavar="N",
                        help="sequences decoded together in one batch (default 8; fewer if the memory "
                             "budget does not fit their KV cache)")
    parser.add_argument("--max-waiting-requests", type=positive_int, default=DEFAULT_MAX_WAITING_REQUESTS, metavar="N",
                        help="answer 503 (with Retry-After) to a request that finds N requests already waiting "
                             f"for a free batch slot (default {DEFAULT_MAX_WAITING_REQUESTS}); running requests are "
                             "never affected")
    parser.add_argument("--limit-concurrency", type=positive_int, default=DEFAULT_LIMIT_CONCURRENCY, metavar="N",
                        help="requests being answered at once, at most (a stream counts until its last event; idle "
                             "connections do not count); past it the server answers 503, code server_overloaded, "
                             f"with Retry-After; /health is always answered (default {DEFAULT_LIMIT_CONCURRENCY})")
    parser.add_argument("--timeout-headers", type=_seconds, default=DEFAULT_TIMEOUT_HEADERS, metavar="S",
                        help="close a connection whose request head has not fully arrived S seconds after the "
                             "connection opened or the previous answer ended (default "
                             f"{DEFAULT_TIMEOUT_HEADERS:g})")
    parser.add_argument("--timeout-body", type=_seconds, default=DEFAULT_TIMEOUT_BODY, metavar="S",
                        help="answer 408 and close the connection when a request's body has not fully arrived S "
                             f"seconds after its head (default {DEFAULT_TIMEOUT_BODY:g})")
    parser.add_argument("--timeout-keep-alive", type=_seconds, default=DEFAULT_TIMEOUT_KEEP_ALIVE, metavar="S",
                        help="close an idle connection S seconds after its last answer (uvicorn's; default "
                             f"{DEFAULT_TIMEOUT_KEEP_ALIVE:g})")
    parser.add_argument("--default-max-tokens", type=positive_int, default=DEFAULT_CHAT_MAX_TOKENS, metavar="N",
                        help="completion tokens of a chat request that sets no max_tokens, at most (default "
                             f"{DEFAULT_CHAT_MAX_TOKENS}; fewer if the context has less room; text completions "
                             "default to 16, as OpenAI's)")
    parser.add_argument("--special-tokens-in-messages", action="store_true",
                        help="tokenize special-token text inside chat messages (e.g. `<|im_start|>`) as the control "
                             "token it spells, as before; by default it is plain text, so that a user cannot open "
                             "turns of other roles")
    parser.add_argument("--lenient-json-schemas", action="store_true",
                        help="JSON schemas (response_format, required tool calls) allow properties they do not list "
                             "unless they set additionalProperties or the request asks for strict (JSON Schema's own "
                             "default, as before); by default only the listed properties are allowed, as vLLM's "
                             "xgrammar does")
    parser.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="S",
                        help="on SIGTERM, take no new requests (503; /health answers 503) and give those in flight "
                             f"S seconds to finish before cancelling them (default {DEFAULT_SHUTDOWN_TIMEOUT:g}); "
                             "SIGINT, or a second SIGTERM, cancels them at once")
    parser.add_argument("--engine-nice", type=_nice, default=DEFAULT_ENGINE_NICE, metavar="N",
                        help="run the engine's threads (decoding, and the compute threads they start) N steps of "
                             "nice below the HTTP server's, so that a busy engine cannot hold back parsing, "
                             "refusals and health checks on a machine whose cores it fills (Linux; default "
                             f"{DEFAULT_ENGINE_NICE}; 0: the same priority)")
    parser.add_argument("--dry-run", action="store_true", help="load, print the memory breakdown and exit")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every route but /health (401 without it)")
    parser.add_argument("--public-metrics", action="store_true",
                        help="with --api-key: serve /metrics without the key too, for a Prometheus scraper (it "
                             "shows token counts moving with other users' requests)")
    parser.add_argument("--responses-db", default=None, metavar="PATH",
                        help="the SQLite file keeping /v1/responses' stored responses across restarts, shared by the "
                             "replicas of a machine (default $SPECDEC_RESPONSES_DB, else $SPECDEC_HOME/responses.sqlite3; "
                             "'memory': in this process only)")
    parser.add_argument("--responses-retention-hours", type=float, default=720.0, metavar="H",
                        help="stored responses older than this are gone (default 720: 30 days, as OpenAI's)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name(s) clients use (default: TARGET as given)")
    # vLLM's flags, with vLLM's meanings where they apply here
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the random generator that samples requests carrying no seed")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template (a file, or the template itself) instead of the model's")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--log-requests", action="store_true",
                        help="a line per finished request on stderr: its prompt (cached, from disk), the time to restore "
                             "and compute it, its first token, its decoding")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="no line per request in the log (uvicorn's access log)")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="default sampling parameters: 'auto' reads the model folder's generation_config.json "
                             "(a GGUF file has none), a FOLDER reads its own, 'vllm' uses none (as in vLLM)")
    parser.add_argument("--override-generation-config", default=None, metavar="JSON",
                        help="default sampling parameters set on top, e.g. '{\"temperature\": 0.5}'")
    add_replica_arguments(parser.add_argument_group("replicas (Ray Serve; docs/replicas.md)"))
    add_llm_arguments(parser)
    parser.set_defaults(prefix_cache_disk=True)  # a server keeps its prefix cache across restarts
    return parser


def add_replica_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                       help="serve N engine replicas as Ray Serve deployments behind one HTTP address (a local Ray "
                            "unless RAY_ADDRESS names a cluster); default: one engine in this process, no Ray")
    group.add_argument("--routing", choices=("affinity", "default"), default="affinity",
                       help="with --replicas: 'affinity' sends a request to the replica holding its prompt's "
                            "cached prefix unless that one is saturated (then the least-loaded); 'default' is Ray "
                            "Serve's power-of-two-choices router (default: affinity)")
    group.add_argument("--replica-threads", type=positive_int, default=1, metavar="T",
                       help="with --replicas: CPU threads (and Ray CPUs) of each replica (default 1)")
    group.add_argument("--replica-max-ongoing-requests", type=positive_int, default=None, metavar="N",
                       help="with --replicas: requests a replica takes at once; past it a replica counts as "
                            "saturated and Ray Serve sends elsewhere or queues (default: twice --max-num-seqs)")


GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def generation_defaults(args: argparse.Namespace, model_path: str | Path) -> dict[str, Any]:
    """The defaults requests take for the sampling parameters they leave out (vLLM's --generation-config):
    the keys of GENERATION_DEFAULTS found in generation_config.json, then --override-generation-config.
    Example: Qwen2.5's folder gives {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}."""
    found: dict[str, Any] = {}
    if args.generation_config != "vllm":
        folder = Path(model_path) if args.generation_config == "auto" else Path(args.generation_config).expanduser()
        config = folder / "generation_config.json" if folder.is_dir() else None
        if args.generation_config not in ("auto", "vllm") and (config is None or not config.is_file()):
            raise ValueError(f"--generation-config {args.generation_config}: no generation_config.json there")
        if config is not None and config.is_file():
            found = json.loads(config.read_text())
    if args.override_generation_config:
        try:
            override = json.loads(args.override_generation_config)
        except json.JSONDecodeError:
            override = None
        if not isinstance(override, dict):
            raise ValueError("--override-generation-config must be a JSON object")
        unknown = sorted(set(override) - set(GENERATION_DEFAULTS))
        if unknown:
            raise ValueError(f"--override-generation-config: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(GENERATION_DEFAULTS)}")
        found = {**found, **override}
    return {k: found[k] for k in GENERATION_DEFAULTS if found.get(k) is not None}


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file's text, or the argument itself when it is not a file (as vLLM does)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def run_serve(args: argparse.Namespace) -> int:
    """Load the models, print what was loaded, serve until SIGINT/SIGTERM. Returns the exit status."""
    from specdec.api import DEFAULT_TARGET

    target = args.model or DEFAULT_TARGET
    draft = args.speculative_model  # none given: auto speculation (the suffix tries and the target's heads)
    if args.replicas is not None and not args.dry_run:
        from specdec.server.replicas import ReplicaSpec, serve_replicas

        return serve_replicas(ReplicaSpec(args))
    from specdec.engine.memory import MemoryBudgetError

    try:
        llm = load_for_serving(args, target, draft)
        defaults = generation_defaults(args, getattr(llm, "target_path", target))
    except (ValueError, LookupError, FileNotFoundError, NotImplementedError, MemoryBudgetError) as e:
        print(f"specdec serve: {e}", file=sys.stderr)
        return 2
    names = args.served_model_name or [target]
    _print_startup(llm.describe(), llm.memory_plan.report(), names, args, defaults)
    if args.dry_run:
        return 0
    return _serve(llm, names, args, defaults)


def load_engine(args: argparse.Namespace) -> tuple[Any, list[str], dict[str, Any]]:
    """An engine replica's (`specdec.server.replicas`): the engine the flags describe, the served names and
    `build_app`'s options."""
    from specdec.api import DEFAULT_TARGET

    target = args.model or DEFAULT_TARGET
    llm = load_for_serving(args, target, args.speculative_model)
    defaults = generation_defaults(args, getattr(llm, "target_path", target))
    return llm.engine, args.served_model_name or [target], app_options(args, llm, target, defaults)


def load_tokenizer(args: argparse.Namespace):
    """The ingress's tokenizer (`specdec.server.replicas`): the target's, with --chat-template, no weights."""
    from specdec.api import DEFAULT_TARGET
    from specdec.llm_args import pull_if_needed
    from specdec.models.loading import load_tokenizer as read_tokenizer
    from specdec.models.store import resolve_model

    target = args.model or DEFAULT_TARGET
    pull_if_needed(target)
    tokenizer = read_tokenizer(resolve_model(target))
    if args.chat_template is not None:
        tokenizer.set_chat_template(read_chat_template(args.chat_template))
    return tokenizer


def app_options(args: argparse.Namespace, llm, name: str, sampling_defaults: dict[str, Any] | None) -> dict[str, Any]:
    """`build_app`'s keyword arguments from the flags (the engine and the names aside)."""
    return dict(api_key=args.api_key, model_root=str(getattr(llm, "target_path", name)),
                sampling_defaults=sampling_defaults, default_max_tokens=args.default_max_tokens,
                special_tokens_in_messages=args.special_tokens_in_messages,
                limit_concurrency=args.limit_concurrency, timeout_body=args.timeout_body,
                public_metrics=args.public_metrics, lenient_json_schemas=args.lenient_json_schemas,
                responses_db=responses_db(args), responses_retention_s=args.responses_retention_hours * 3600)


def responses_db(args: argparse.Namespace) -> str | None:
    """The file of the stored responses (`--responses-db`), or None to keep them in memory."""
    from specdec.config import specdec_home

    path = args.responses_db or os.environ.get("SPECDEC_RESPONSES_DB") or str(specdec_home() / "responses.sqlite3")
    return None if path == "memory" else path


def load_for_serving(args: argparse.Namespace, target: str, draft: str | None):
    """The LLM that `serve` runs, built from its flags (`build_llm`), with its chat template and seed."""
    import torch

    llm = build_llm(args, target, draft, max_num_seqs=args.max_num_seqs)
    if args.chat_template is not None:
        llm.tokenizer.set_chat_template(read_chat_template(args.chat_template))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    return llm


def _serve(llm, names: list[str], args: argparse.Namespace, sampling_defaults: dict[str, Any] | None = None) -> int:
    """The engine loop in the main thread, the HTTP server (uvicorn) in another (see `AsyncEngine.run`).
    SIGTERM drains (`AsyncEngine.drain`): new requests and /health are answered 503 while the requests in
    flight get `--shutdown-timeout` seconds to finish; then the rest are cancelled (their streams end with
    an error event saying so), the engine loop ends, and uvicorn closes. SIGINT, or a second SIGTERM,
    cancels the requests in flight at once; a second SIGINT forces the exit."""
    import uvicorn

    from specdec.server.app import build_app
    from specdec.server.async_engine import AsyncEngine
    from specdec.server.limits import uvicorn_config

    engine = AsyncEngine(llm.engine, max_waiting_requests=args.max_waiting_requests, own_thread=False)
    if args.log_requests:
        from specdec.server.request_log import RequestLog

        engine.add_step_listener(RequestLog().on_step)
    app = build_app(engine, names, **app_options(args, llm, names[0], sampling_defaults))
    config = uvicorn_config(app, args.host, args.port, timeout_headers=args.timeout_headers,
                            timeout_keep_alive=args.timeout_keep_alive, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_log_requests, timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)  # outside the main thread uvicorn leaves the signals alone

    def serve_http() -> None:
        try:
            server.run()
        finally:  # stopped, or failed to start (port taken): end the engine loop too
            engine.shutdown(timeout=0)

    def on_signal(sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not draining:
            draining.append(sig)
            engine.drain(args.shutdown_timeout)  # engine.run() returns once drained
            return
        engine.shutdown(timeout=0)
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    draining: list[int] = []
    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    engine_threads = thread_ids()  # all the engine's so far: this thread, torch's compute threads
    http = threading.Thread(target=serve_http, name="specdec-http")
    http.start()  # it, and the threads it starts, keep this process's priority
    lower_priority(engine_threads, args.engine_nice)  # threads the engine starts later inherit it
    try:
        engine.run()
    finally:
        server.should_exit = True
        http.join()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1


def _print_startup(info: dict[str, Any], memory_report: str, names: list[str], args: argparse.Namespace,
                   defaults: dict[str, Any]) -> None:
    spec = info.get("speculative")
    print(f"specdec serve: target {info.get('model')} ({info.get('model_path')})")
    print(f"  device {info.get('device')}, dtype {info.get('dtype')}, max_model_len {info.get('max_model_len')}")
    if spec:
        settings = ", ".join(f"{k}={v}" for k, v in spec.items())
        print(f"  speculation: {settings}")
    else:
        print("  speculation: off")
    print("\n".join(f"  {line}" for line in memory_report.splitlines()))
    disk = info.get("prefix_cache_disk")
    if disk:
        print(f"  prefix cache on disk: {disk['dir']}, up to {disk['budget_bytes'] / 2**30:.1f} GiB shared by the "
              f"processes there ({disk['used_bytes'] / 2**30:.2f} GiB now; --no-prefix-cache-disk: RAM only)")
    key = "" if not args.api_key else "; API key required on every route but /health" + \
        (" and /metrics" if args.public_metrics else "")
    print(f"  served model name: {', '.join(names)}{key}")
    if defaults:
        print(f"  default sampling parameters ({args.generation_config}): "
              + ", ".join(f"{k}={v}" for k, v in defaults.items()))
    print(f"  limits: {args.max_waiting_requests} requests waiting for a slot and {args.limit_concurrency} being "
          f"answered (more are answered 503); a request's head within {args.timeout_headers:g} s, its body within "
          f"{args.timeout_body:g} s more; idle connections closed after {args.timeout_keep_alive:g} s; chat "
          f"completions without max_tokens: {args.default_max_tokens} tokens at most; SIGTERM gives requests in "
          f"flight {args.shutdown_timeout:g} s to finish; the engine's threads {args.engine_nice} steps of nice below "
          f"the HTTP server's")
    print(f"  OpenAI API at http://{_url_host(args.host)}:{args.port}/v1", flush=True)


def thread_ids() -> list[int]:
    """The native ids of this process's threads (Linux; [] elsewhere)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []


def lower_priority(tids: list[int], steps: int) -> None:
    """Add `steps` to the nice value of each thread in `tids` (Linux keeps a nice value per thread, and a thread
    starts with its creator's), at most 19; a thread gone meanwhile, or one the user may not change, is left.
    Measured (docs/server.md, "The flood a third time"): 8 refused 3 MB /tokenize calls beside a greedy stream
    on 2 cores, the slowest 0.085-0.139 s a round with the engine at the HTTP thread's priority, 0.044-0.050 s
    at 5 steps below; the stream alone as fast."""
    if steps <= 0 or not sys.platform.startswith("linux"):
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
        except OSError:
            pass


def _nice(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"must be 0 to 19, got {text}")
    return value


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    """`python -m specdec.server.cli` (the same as `specdec serve`)."""
    parser = add_serve_arguments(argparse.ArgumentParser(prog="specdec serve"))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
