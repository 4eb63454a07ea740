"""``v41.AsyncEngine``: the engine core on a background thread, streamed with ``async for``.

The core is single-threaded; callers talk to it through an inbox (add, abort) drained at the start of every
step, and receive outputs on per-request asyncio queues. A stream that is closed or cancelled before its
request finished aborts the request (KF-17), so its blocks are freed within about one step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator

from .args import EngineArgs
from .core import EngineCore
from .info import engine_info
from .llm import model_or_embedded
from .prompts import PromptLike, encode_prompt, prompt_cache_salt
from .params import RequestOutput, SamplingParams

log = logging.getLogger("v41.engine")
STEP_TIMEOUT_ENV = "V41_STEP_TIMEOUT_S"  # one step longer than this: the loop counts as wedged (default 600 s)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a crash or shutdown); in-flight requests fail with this error."""


class AsyncEngine:
    """Asynchronous front of :class:`EngineCore`. ``generate`` yields :class:`RequestOutput` deltas: each
    completion's ``text`` and ``token_ids`` hold only what is new since the previous yield; the last one
    has ``finished=True`` and a finish reason. Satisfies ``v41.serve.EngineProtocol`` (the in-process
    engine of the front ends' tests); ``last_heartbeat_s`` is "now" while the loop thread lives and its
    current step has run at most ``$V41_STEP_TIMEOUT_S`` (default 600 s); ``info`` is the core's resolved
    configuration (:func:`v41.engine.info.engine_info`, taken at start). Built from ``args``, an existing
    ``core``, or :class:`EngineArgs` keywords (``model`` None or absent: the embedded tiny model, as ``LLM``)."""

    def __init__(self, args: EngineArgs | None = None, core: EngineCore | None = None, **kwargs):
        if core is None and args is None:
            kwargs["model"] = model_or_embedded(kwargs.get("model"))
        self.core = core or EngineCore(args or EngineArgs(**kwargs))
        self.info: dict = engine_info(self.core)  # before the loop thread owns the core
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        self._step_timeout_s = float(os.environ.get(STEP_TIMEOUT_ENV, "600"))
        self._tick_s = time.monotonic()  # the loop's last pass
        self._busy_since: float | None = None  # start of the running step
        self._started_s = time.monotonic()
        self._num_steps = 0
        self._thread = threading.Thread(target=self._loop, name="v41-engine-core", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def cfg(self):
        return self.core.cfg

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def model_dir(self) -> str:
        return str(self.core.args.model)

    @property
    def max_n(self) -> int:
        """The most completions one request may ask for (``EngineArgs.max_n``)."""
        return self.core.args.max_n

    @property
    def last_heartbeat_s(self) -> float:
        """``time.monotonic()`` of the loop's last sign of life: now while it runs and is not wedged."""
        now = time.monotonic()
        if not self.is_running:
            return self._tick_s
        busy = self._busy_since
        if busy is not None and now - busy > self._step_timeout_s:
            return busy + self._step_timeout_s
        return now

    async def stats(self) -> dict:
        """Scheduler stats + ``engine`` info (the shape of ``v41.serve.EngineProtocol.stats``); answered by the
        loop between steps. Raises EngineDeadError when the loop is not running."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self.error
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("stats", fut))
        waiter = asyncio.wrap_future(fut)
        while True:  # a loop that stops before answering must not leave the caller waiting
            done, _ = await asyncio.wait({waiter}, timeout=1.0)
            if done:
                return waiter.result()
            if not self.is_running:
                waiter.cancel()
                raise EngineDeadError("the engine is not running") from self.error

    # -- public --------------------------------------------------------------------------------------------
    async def generate(self, prompt: PromptLike, params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request. ``priority`` (lower runs first) and ``cache_salt`` (prefix-cache namespace) as
        in :meth:`EngineCore.add_request`. Raises ValueError for a bad prompt or parameters (before any
        output) and EngineDeadError if the engine stops while the request runs."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self.error
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (loop, stream)
        self._send(("add", rid, prompt, params or SamplingParams(), priority, cache_salt))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._send(("abort", rid))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish reason ``abort``."""
        self._send(("abort", request_id))

    def shutdown(self) -> None:
        """Stop the loop; pending streams fail with EngineDeadError."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.core.shutdown()

    # -- engine thread -----------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def _deliver(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _drain(self) -> None:
        core = self.core
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "stats":
                stats = dict(core.stats())
                stats["engine"] = {"pid": os.getpid(), "model_dir": str(core.args.model),
                                   "max_model_len": core.max_model_len, "num_steps": self._num_steps,
                                   "num_requests": len(core.requests),
                                   "uptime_s": time.monotonic() - self._started_s, "stale": False}
                msg[1].set_result(stats)
            elif msg[0] == "add":
                _, rid, prompt, params, priority, cache_salt = msg
                try:
                    text, ids = encode_prompt(core, prompt)
                    core.add_request(rid, ids, params, prompt=text, priority=priority,
                                     cache_salt=prompt_cache_salt(prompt, cache_salt))
                except ValueError as e:
                    self._deliver(rid, e)
            else:
                out = core.abort_request(msg[1])
                if out is not None:
                    self._deliver(msg[1], out)

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._tick_s = time.monotonic()
                self._drain()
                if not self.core.has_unfinished():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                self._busy_since = time.monotonic()
                outs = self.core.step()
                self._busy_since = None
                self._num_steps += 1
                for out in outs:
                    self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - every stream must learn that the engine died
            log.exception("engine loop died")
            self.error = e
        finally:
            err = EngineDeadError("the engine loop stopped")
            if self.error is not None:
                err.__cause__ = self.error
            for rid in list(self._streams):
                self._deliver(rid, err)
            self._fail_pending(err)

    def _fail_pending(self, err: BaseException) -> None:
        """Fail stats requests still in the inbox (the loop will not answer them)."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "stats" and not msg[1].done():
                msg[1].set_exception(err)
