"""The engine's loop and its bridge to asyncio.

`Engine` is synchronous and not thread-safe, so exactly one thread drives it: a thread of its own
(`start()`), or the caller's (`run()`, which `specdec serve` uses for the main thread, the HTTP server
running in another; see `run`). Handlers talk to that thread
through a `queue.SimpleQueue` of commands (add, abort, drain, stop); the thread answers each request through the
request's own `asyncio.Queue`, filled with `loop.call_soon_threadsafe`. The event loop never waits on the
model. With `max_waiting_requests=N` the thread refuses a request (QueueFullError) while N others wait for
a free batch slot; it alone reads the engine's queue, so the count is exact. A request that the engine fails
alone (`RequestOutput.error`) ends its stream with RequestFailedError; an exception out of a whole step ends
every stream in flight. `drain(timeout)` is a graceful shutdown: no new requests, and those in flight get
`timeout` seconds to finish.

    stream = await async_engine.add_request(request_id, prompt_token_ids, params)  # ValueError if refused
    try:
        async for output in stream:   # one RequestOutput per engine step that advanced this request
            ...
    finally:
        stream.close()                # aborts the request if it has not finished (client gone, error)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from specdec.config import SamplingParams
from specdec.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine thread is shutting down (or died); the request was not or will not be completed."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (the others went on); the details are in the server log."""

    def __init__(self, request_id: str):
        super().__init__(f"The engine failed while generating request {request_id}; the other requests were not "
                         f"affected. The server log has the details under this request id.")
        self.request_id = request_id


class QueueFullError(RuntimeError):
    """`max_waiting_requests` requests already wait for a free batch slot; this one was not queued."""

    def __init__(self, limit: int):
        super().__init__(f"The server is busy: the queue of requests waiting for a free slot is full "
                         f"(max_waiting_requests = {limit}). Retry later.")
        self.limit = limit


class _Accepted:
    """Put on a request's queue once `Engine.add_request` has taken it."""


_ACCEPTED = _Accepted()


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    cache_salt: str | None = None


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Drain:
    timeout: float


class _Stop:
    pass


class RequestStream:
    """The outputs of one request, as an async iterator; `close()` aborts it unless it has finished."""

    def __init__(self, owner: "AsyncEngine", request_id: str, outputs: asyncio.Queue):
        self._owner, self.request_id, self._outputs = owner, request_id, outputs
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._outputs.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    """Runs `engine` in a daemon thread (`start()`), or, with `own_thread=False`, in the thread that calls
    `run()`. Listeners added with `add_step_listener(fn)` are called in that thread after each step with
    the step's outputs (e.g. to update Prometheus counters); they must not block.
    `max_waiting_requests` bounds `engine.num_queued()` (None: unbounded); running requests are never touched."""

    def __init__(self, engine: Any, max_waiting_requests: int | None = None, own_thread: bool = True):
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.own_thread = own_thread  # False: `run()` drives the loop in the caller's thread; `start()` does nothing
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size  # the model's logits width
        self._listeners: list[Callable[[list[RequestOutput]], None]] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from signal handlers
        self._streams: dict[str, _Add] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._stopping = False
        self._drain_deadline: float | None = None  # engine thread only: set by a drain command
        self._drain_timeout = 0.0
        self._stop_error = EngineStoppedError("The server is shutting down; the request was cancelled.")
        self._driver: threading.Thread | None = None  # the thread in run(), with own_thread=False
        self._done = threading.Event()  # the loop has ended (and failed what was in flight)

    # ---- the asyncio side ----------------------------------------------------------------------------

    def add_step_listener(self, fn: Callable[[list[RequestOutput]], None]) -> None:
        self._listeners.append(fn)

    def start(self) -> None:
        if self.own_thread and self._thread.ident is None and not self._stopping:
            self._thread.start()

    def run(self) -> None:
        """Drive the engine in the calling thread until `shutdown()` (with own_thread=False).

        Why `specdec serve` gives it the main thread, the one that loaded the model: measured on 2 cores, a
        1-token decode step took ~20% longer in a second thread than in the main thread, and the server's
        time per output token at one client went from 180-230 ms to 148-167 ms once the engine ran there.
        The likely cause: PyTorch's CPU ops run on an OpenMP team per calling thread, and with a second
        team on a machine with few cores the workers sleep between ops instead of spinning (forcing them
        to spin made the second thread slower still), so each of the hundreds of ops of a forward waits
        for a wake-up."""
        if self.own_thread:
            raise RuntimeError("run() drives an AsyncEngine made with own_thread=False; this one has a thread")
        self._driver = threading.current_thread()
        self._run()

    @property
    def healthy(self) -> bool:
        alive = self._thread.is_alive() if self.own_thread else not self._done.is_set()
        return alive and not self._stopping

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          cache_salt: str | None = None) -> RequestStream:
        """Queue a request; returns once the engine took it. Raises ValueError (e.g. too long for the
        context) if the engine refused it, QueueFullError if too many requests wait already,
        EngineStoppedError if the engine is shutting down."""
        if not self.healthy:
            raise EngineStoppedError("the engine is shutting down" if self._stopping else "the engine is not running")
        outputs: asyncio.Queue = asyncio.Queue()
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, asyncio.get_running_loop(), outputs,
                             cache_salt))
        stream = RequestStream(self, request_id, outputs)
        try:
            first = await outputs.get()
        except BaseException:  # cancelled while waiting (client gone): make sure it does not run
            stream.close()
            raise
        if isinstance(first, BaseException):
            stream.finished = True
            raise first
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def drain(self, timeout: float) -> None:
        """Graceful shutdown: take no new requests (`healthy` turns False, `add_request` raises
        EngineStoppedError), let those in flight finish for up to `timeout` seconds, then cancel the rest
        (EngineStoppedError saying so) and stop, as `shutdown` does. Only asks: safe from a signal handler."""
        self._stopping = True
        self._inbox.put(_Drain(timeout))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort every request (their streams raise EngineStoppedError) and stop the thread. Safe to call
        more than once, and from a signal handler when `timeout == 0` (it then only asks)."""
        self._stopping = True
        self._inbox.put(_Stop())
        if not timeout:
            return
        if self.own_thread:
            if self._thread.is_alive() and threading.current_thread() is not self._thread:
                self._thread.join(timeout)
        elif self._driver is not None and threading.current_thread() is not self._driver:
            self._done.wait(timeout)

    # ---- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._handle_commands(block=not self.engine.has_unfinished_requests() and not self._draining()):
                if self._draining() and not self.engine.has_unfinished_requests():
                    break  # drained
                if self._draining() and time.monotonic() >= self._drain_deadline:
                    self._stop_error = EngineStoppedError(
                        f"The server is shutting down and this request did not finish within the shutdown timeout "
                        f"({self._drain_timeout:g} s); it was cancelled.")
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException:  # a bug in the loop itself: fail what is in flight, loudly
            logger.exception("the engine thread died")
        finally:
            self._stopping = True
            stopped = self._stop_error
            self._fail_all(stopped)
            while True:  # requests queued after the stop command: refuse them rather than leave them waiting
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, _Add):
                    _send(cmd, stopped)
            self._done.set()

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once asked to stop."""
        while True:
            try:
                # a bounded wait: a signal that the OS hands to another thread (SIGTERM reaches any thread of
                # the process) only runs its Python handler once the main thread leaves a blocking call
                cmd = self._inbox.get(block=block, timeout=_IDLE_WAKE_S if block else None)
            except queue.Empty:
                return True
            block = False
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Drain) and not self._draining():
                self._drain_deadline, self._drain_timeout = time.monotonic() + cmd.timeout, cmd.timeout
                logger.info("draining: %d requests in flight get %g s to finish", len(self._streams), cmd.timeout)
            elif isinstance(cmd, _Add) and self._draining():  # sent before the drain began, taken after
                _send(cmd, EngineStoppedError("The server is shutting down and takes no new requests."))
            elif isinstance(cmd, _Add):
                limit = self.max_waiting_requests
                if limit is not None and self.engine.num_queued() >= limit:
                    _send(cmd, QueueFullError(limit))
                    continue
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                            cache_salt=cmd.cache_salt)
                except Exception as e:  # ValueError: refused (too long, bad params); answered to the caller
                    _send(cmd, e)
                    continue
                self._streams[cmd.request_id] = cmd
                _send(cmd, _ACCEPTED)
            elif isinstance(cmd, _Abort) and self._streams.pop(cmd.request_id, None) is not None:
                self.engine.abort_request(cmd.request_id)

    def _draining(self) -> bool:
        return self._drain_deadline is not None

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; aborting the requests in flight: %s", ", ".join(self._streams))
            self._fail_all(RuntimeError("The engine failed and aborted every request in flight, this one included; "
                                        "the server log has the details."))
            return
        for listener in self._listeners:
            try:
                listener(outputs)
            except Exception:
                logger.exception("step listener %r failed", listener)
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is None:  # aborted by us: the engine reports it once more, nobody listens
                continue
            if out.finished:
                del self._streams[out.request_id]
            _send(target, _snapshot(out) if out.error is None else RequestFailedError(out.request_id))

    def _fail_all(self, error: BaseException) -> None:
        for request_id, target in list(self._streams.items()):
            _send(target, error)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort_request(%s) failed", request_id)
        self._streams.clear()


_IDLE_WAKE_S = 0.25  # how often an idle engine loop wakes (so that signals are handled in the main thread)


def _send(target: _Add, item: Any) -> None:
    try:
        target.loop.call_soon_threadsafe(target.queue.put_nowait, item)
    except RuntimeError:  # the event loop is closed: nobody is waiting any more
        pass


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the event loop can read while the engine keeps mutating its own lists and counters."""
    return dataclasses.replace(
        out,
        prompt_token_ids=list(out.prompt_token_ids),
        new_token_ids=list(out.new_token_ids),
        token_ids=list(out.token_ids),
        metrics=dataclasses.replace(out.metrics, accepted_per_position=list(out.metrics.accepted_per_position),
                                    drafters={k: v.copy() for k, v in out.metrics.drafters.items()}),
    )
