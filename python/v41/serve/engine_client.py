"""The interface the front ends program against (:class:`EngineProtocol`) and its out-of-process
implementation (:class:`EngineClient`): the engine core in a process of its own, spoken to over ZMQ with the
typed messages of :mod:`v41.serve.messages` (docs/architecture.md §3).

:class:`~v41.engine.async_engine.AsyncEngine` (the engine on a thread of this process) satisfies the same
protocol; front ends and their tests may use either.

``EngineClient`` threads and sockets: ``ipc://`` sockets in a private temp dir, both bound here before the
process starts (PUSH to the engine's inbox, PULL from its results). Sends come from any thread under a lock;
one receiver thread decodes the engine's messages and hands each request's deltas to its stream (an asyncio
queue on the caller's loop, so several event loops may share one client). The receiver also watches the
process: when it exits, or sends nothing (not even a heartbeat) for ``heartbeat_timeout_s``, the engine counts
as dead — the failure is logged, every in-flight stream raises :class:`EngineDeadError` at once, later calls
raise it immediately, and an unresponsive process is killed. No call waits without a deadline.

Prompts are tokenized here (the front end's job), by the same ``encode_prompt`` as the engine's: text gets
BOS prepended and no chat template; chat prompts come in as token ids from ``v41.chat``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import zmq

from ..engine.args import EngineArgs
from ..engine.async_engine import EngineDeadError
from ..engine.params import RequestOutput, SamplingParams
from ..engine.prompts import encode_prompt, prompt_cache_salt, validate_request
from . import messages as m
from .errors import QueueFullError  # more requests in flight than max_num_seqs + max_queue_len: HTTP 429

log = logging.getLogger("v41.serve")
HEARTBEAT_TIMEOUT_ENV = "V41_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0
STATS_TIMEOUT_S = 2.0
_POLL_MS = 100


class EngineStartupError(RuntimeError):
    """The engine-core process did not start: the message says why (bad model directory, bad options, the
    process died or timed out before it was ready)."""


@runtime_checkable
class EngineProtocol(Protocol):
    """What the HTTP and gRPC front ends need from an engine.

    ``generate(prompt, params, request_id, *, priority=0, cache_salt=None)`` is an async generator of
    :class:`RequestOutput` *deltas*: each completion's ``text``, ``token_ids`` and ``logprobs`` hold only what
    is new since the previous yield (several tokens per yield are possible); ``prompt``, ``prompt_token_ids``,
    ``num_cached_tokens`` and ``prompt_logprobs`` (the list so far) are whole. The last yield has
    ``finished=True`` and every completion's ``finish_reason`` ("stop" | "length" | "abort") and
    ``stop_reason``. ``prompt`` is text (BOS prepended, no chat template), a list of token ids, or
    ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` (a dict may add ``"cache_salt"``). ``priority``: lower
    runs first; ``cache_salt``: the prefix-cache namespace (both as in ``EngineCore.add_request``).
    Errors: ``ValueError`` for bad input (empty or too long prompt, prompt + max_tokens over max_model_len,
    invalid sampling values, ``n`` above ``max_n``, a priority outside int32, an empty or non-UTF-8
    cache_salt, a request id already in flight), raised before any output; ``EngineDeadError`` when the
    engine is dead or dies during the request; ``QueueFullError`` (EngineClient with a queue limit). Closing
    or cancelling the iterator before the end aborts the request (its blocks are freed within about one step).

    ``max_n``: the most completions (``SamplingParams.n``) one request may ask for (``EngineArgs.max_n``); the
    front ends refuse a larger ``n`` before tokenizing (``serve/validation.py``).
    ``abort(request_id)``: end a request now; its stream ends with finish reason "abort" (no-op if unknown).
    ``stats()``: scheduler stats — ``running``, ``waiting``, ``blocks`` ({kind: {used, cached, free, total}}:
    ``used`` counts every held block, ``cached`` those held only by the prefix cache; ``metrics.kv_blocks``),
    ``prefix_query_tokens``, ``prefix_hit_tokens``, ``prefix_hit_rate``, ``prefix_cached_pages``,
    ``num_preemptions``, ``spec_decode`` while the engine speculates (``SpecDecodeStats.to_dict`` of every
    sequence since start: ``EngineCore.spec_decode_stats``) — plus ``engine`` ({pid, model_dir, max_model_len,
    num_steps, num_requests, uptime_s, stale}). ``stale`` is True when a long step kept the engine from answering
    and the figures are those of the last step.

    ``last_heartbeat_s``: ``time.monotonic()`` of the engine loop's last sign of life. It stays fresh (within
    about a second) while the engine is alive, also through a long prefill, and freezes when the engine is dead
    or wedged (one step running longer than ``$V41_STEP_TIMEOUT_S``, default 600 s). A health check is
    ``is_running and time.monotonic() - last_heartbeat_s < 5``.
    ``shutdown()``: stop the engine; in-flight streams end (aborted, or with EngineDeadError); idempotent,
    blocking. Optional: ``info``, the engine's resolved configuration (:func:`v41.engine.info.engine_info`),
    which gRPC ``GetModelInfo`` / ``GetServerInfo`` report.
    """

    def generate(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str, *,
                 priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> dict: ...

    @property
    def tokenizer(self) -> Any: ...  # tokenizers.Tokenizer

    @property
    def cfg(self) -> Any: ...  # v41.config.ModelConfig

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_n(self) -> int: ...

    @property
    def model_dir(self) -> str: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def last_heartbeat_s(self) -> float: ...

    def shutdown(self) -> None: ...


class _Stream:
    """One in-flight request: where its items go and the prompt fields the deltas leave out."""

    __slots__ = ("loop", "queue", "prompt", "prompt_token_ids", "prompt_logprobs")

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt: str | None, prompt_token_ids: list[int]):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs: list | None = None

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


class EngineClient:
    """:class:`EngineProtocol` over an engine-core process (module doc).

    args: the engine's options. threads: torch CPU threads in the engine process (default 1).
    startup_timeout_s: how long to wait for the model to load (default 600). heartbeat_timeout_s: silence
    after which a running engine counts as dead (default ``$V41_HEARTBEAT_TIMEOUT_S`` or 30).
    max_queue_len: requests allowed beyond ``max_num_seqs`` before ``QueueFullError`` (None = no limit).
    env: extra environment variables of the engine process.
    Raises EngineStartupError when the process does not come up (the message carries its error).
    """

    def __init__(self, args: EngineArgs, *, threads: int = 1, startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 heartbeat_timeout_s: float | None = None, max_queue_len: int | None = None,
                 env: dict[str, str] | None = None):
        args.validate()
        self.args = args
        self.heartbeat_timeout_s = heartbeat_timeout_s or m.env_seconds(HEARTBEAT_TIMEOUT_ENV,
                                                                     DEFAULT_HEARTBEAT_TIMEOUT_S)
        self.max_queue_len = max_queue_len
        self._streams: dict[str, _Stream] = {}
        self._stats_waiters: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count(1)
        self._send_lock = threading.Lock()
        self._dead: str | None = None  # why the engine is dead; None while it runs
        self._closing = False
        self._last_stats: dict = {}
        self.engine_busy_s = 0.0  # how long the engine's current step had run at its last heartbeat
        self._ipc_dir = tempfile.mkdtemp(prefix="v41-engine-")
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.setsockopt(zmq.SNDHWM, 0)
        self._in = self._ctx.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.setsockopt(zmq.RCVHWM, 0)
        in_addr, out_addr = f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output"
        self._out.bind(in_addr)
        self._in.bind(out_addr)
        self.proc = self._spawn(in_addr, out_addr, threads, env)
        self._finalizer = weakref.finalize(self, _kill_and_clean, self.proc, self._ipc_dir)
        try:
            ready = self._wait_ready(startup_timeout_s)
            from tokenizers import Tokenizer

            from ..config import load_config

            self._cfg = load_config(ready.model_dir, self.args.hf_overrides)
            self._tokenizer = Tokenizer.from_file(ready.tokenizer_path)
        except BaseException as e:
            if isinstance(e, EngineStartupError):  # it reported its failure and is exiting by itself
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            _kill(self.proc)
            self._close_sockets()
            raise
        self._ready = ready
        self._last_beat = time.monotonic()
        self._receiver = threading.Thread(target=self._receive_loop, name="v41-engine-client", daemon=True)
        self._receiver.start()
        log.info("engine core ready (pid %d): %s, max_model_len %d, %s blocks of %d tokens per kind %s",
                 ready.pid, ready.model_dir, ready.max_model_len, ready.info["num_blocks"].get("swa", "?"),
                 ready.info["block_tokens"], ready.info["kinds"])

    # -- start-up ----------------------------------------------------------------------------------------------
    def _spawn(self, in_addr: str, out_addr: str, threads: int, env: dict[str, str] | None) -> subprocess.Popen:
        child_env = dict(os.environ)
        pkg_root = str(Path(__file__).resolve().parents[2])  # the directory holding the v41 package
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, child_env.get("PYTHONPATH")) if p)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            child_env.setdefault(name, str(threads))
        child_env.update(env or {})
        cmd = [sys.executable, "-m", "v41.serve.engine_proc", "--input", in_addr, "--output", out_addr,
               "--args", json.dumps(asdict(self.args)), "--parent-pid", str(os.getpid()),
               "--threads", str(threads)]
        # A session of its own: terminal signals reach the server only, which stops the engine in order.
        return subprocess.Popen(cmd, env=child_env, start_new_session=True)

    def _wait_ready(self, timeout_s: float) -> m.Ready:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._in.poll(_POLL_MS):
                msg = m.decode(self._in.recv())
                if isinstance(msg, m.Ready):
                    return msg
                if isinstance(msg, m.StartupFailed):
                    raise EngineStartupError(f"the engine core failed to start: {msg.error_type}: {msg.message}")
                continue  # heartbeats while the model loads
            code = self.proc.poll()
            if code is not None:
                raise EngineStartupError(f"the engine core process exited with status {code} before it was "
                                         "ready (its log is above)")
            if time.monotonic() > deadline:
                raise EngineStartupError(f"the engine core was not ready within {timeout_s:.0f} s")

    # -- EngineProtocol ----------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def cfg(self):
        return self._cfg

    @property
    def max_model_len(self) -> int:
        return self._ready.max_model_len

    @property
    def model_dir(self) -> str:
        return self._ready.model_dir

    @property
    def max_n(self) -> int:
        """The most completions one request may ask for (``EngineArgs.max_n``)."""
        return self.args.max_n

    @property
    def info(self) -> dict:
        """The engine's resolved configuration as the engine process reported it at start-up
        (:func:`v41.engine.info.engine_info`: block_tokens, kinds, num_blocks, enable_prefix_caching,
        max_num_seqs, dtype, device, tensor_parallel_size, engine_args, ...); a copy."""
        return dict(self._ready.info)

    @property
    def pid(self) -> int:
        """The engine-core process id."""
        return self.proc.pid

    @property
    def is_running(self) -> bool:
        return self._dead is None

    @property
    def last_heartbeat_s(self) -> float:
        return self._last_beat

    @property
    def num_in_flight(self) -> int:
        """Requests whose streams are open."""
        return len(self._streams)

    async def generate(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request (EngineProtocol.generate)."""
        self._check_alive()
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        try:
            text, ids = encode_prompt(self, prompt)
            cache_salt = prompt_cache_salt(prompt, cache_salt)
            validate_request(ids, params, priority, cache_salt, self._cfg.vocab_size, self.max_model_len,
                             self.args.max_n)
            msg = m.encode(m.AddRequest(rid, ids, m.params_to_dict(params), text, priority, cache_salt))
        except TypeError as e:  # e.g. a prompt_token_ids entry that is no number
            raise ValueError(f"invalid request: {e}") from e
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        if self.max_queue_len is not None and len(self._streams) >= self.args.max_num_seqs + self.max_queue_len:
            raise QueueFullError(f"{len(self._streams)} requests in flight: the queue is full "
                                 f"(max_num_seqs {self.args.max_num_seqs} + max_queue_len {self.max_queue_len})")
        stream = _Stream(asyncio.get_running_loop(), text, ids)
        self._streams[rid] = stream
        finished = False
        try:
            self._check_alive()  # a death between the first check and the registration above
            self._send_raw(msg)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            if not finished and self._dead is None:
                try:
                    self._send(m.Abort(rid))
                except EngineDeadError:
                    pass

    async def abort(self, request_id: str) -> None:
        """End a request now (EngineProtocol.abort); a no-op when the engine is dead."""
        if self._dead is None:
            try:
                self._send(m.Abort(request_id))
            except EngineDeadError:
                pass

    async def stats(self) -> dict:
        """Scheduler stats + engine info (EngineProtocol.stats). Waits at most ``STATS_TIMEOUT_S`` for the
        engine (a long step delays its answer), then returns the last step's figures with ``stale``."""
        self._check_alive()
        token = next(self._tokens)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._stats_waiters[token] = fut
        self._send(m.StatsRequest(token))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            stats = dict(self._last_stats)
            stats["engine"] = dict(stats.get("engine", {}), stale=True)
            return stats
        finally:
            self._stats_waiters.pop(token, None)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, at most ``timeout_s``; True if idle."""
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.05)
        return not self._streams

    async def abort_all(self) -> int:
        """Abort every in-flight request; returns how many."""
        rids = list(self._streams)
        for rid in rids:
            await self.abort(rid)
        return len(rids)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (it aborts what runs and exits), then close everything; in-flight streams
        raise EngineDeadError. Kills the process if it has not exited within ``timeout_s``. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._dead is None and self.proc.poll() is None:
            try:
                self._send(m.Shutdown())
            except EngineDeadError:
                _kill(self.proc)
        self._stop_process(timeout_s)
        self._receiver.join(timeout=2)
        self._mark_dead("the engine was shut down", log_error=False)
        self._close_sockets()

    # -- internals ---------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")

    def _send(self, msg) -> None:
        self._send_raw(m.encode(msg))

    def _send_raw(self, data: bytes) -> None:
        """Send without blocking (a PUSH socket with no peer would block forever: the engine is gone then).
        Raises EngineDeadError when the message cannot be handed over."""
        with self._send_lock:
            if self._out.closed:
                raise EngineDeadError("the engine was shut down")
            try:
                self._out.send(data, zmq.NOBLOCK)
            except zmq.Again:
                raise EngineDeadError("the engine core is not connected") from None

    def _stop_process(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the engine core (pid %d) did not exit within %.0f s: killing it", self.proc.pid, timeout_s)
            _kill(self.proc)

    def _close_sockets(self) -> None:
        with self._send_lock:
            self._out.close()
        self._in.close()
        self._ctx.term()
        self._finalizer()

    def _receive_loop(self) -> None:
        try:
            self._watch()
        except Exception as e:  # noqa: BLE001 - a bug here must fail the streams, not leave them waiting
            log.exception("the engine client's receiver failed")
            self._mark_dead(f"the engine client's receiver failed: {type(e).__name__}: {e}")
            _kill(self.proc)

    def _watch(self) -> None:
        while not self._closing or self.proc.poll() is None:
            try:
                if self._in.poll(_POLL_MS):
                    self._drain()
            except zmq.ZMQError as e:
                if not self._closing:
                    self._mark_dead(f"the engine socket failed: {e}")
                break
            if self._dead is not None:
                break
            code = self.proc.poll()
            if code is not None:
                try:
                    self._drain()  # what it sent before it went
                except zmq.ZMQError:
                    pass
                if not self._closing:
                    self._mark_dead(f"the engine core process (pid {self.proc.pid}) exited with status {code}")
                break
            silent = time.monotonic() - self._last_beat
            if silent > self.heartbeat_timeout_s and not self._closing:
                self._mark_dead(f"the engine core (pid {self.proc.pid}) sent no heartbeat for {silent:.1f} s "
                                f"(a step running longer than $V41_STEP_TIMEOUT_S, or a hung process): killed")
                _kill(self.proc)
                break

    def _beat(self) -> None:
        self._last_beat = time.monotonic()

    def _drain(self) -> None:
        for msg in m.drain(self._in, log, "the engine core", on_receive=self._beat):
            if isinstance(msg, m.Outputs):
                for d in msg.outputs:
                    self._deliver(d)
            elif isinstance(msg, m.Heartbeat):
                self.engine_busy_s = msg.busy_s
                if msg.stats:
                    self._last_stats = msg.stats
            elif isinstance(msg, m.Error):
                stream = self._streams.get(msg.request_id)
                if stream is not None:
                    exc = ValueError(msg.message) if msg.kind == "invalid" else RuntimeError(msg.message)
                    stream.put(exc)
            elif isinstance(msg, m.StatsReply):
                self._last_stats = msg.stats
                fut = self._stats_waiters.pop(msg.token, None)
                if fut is not None:
                    try:
                        fut.set_result(msg.stats)
                    except concurrent.futures.InvalidStateError:
                        pass  # the caller timed out and cancelled it

    def _deliver(self, d: dict) -> None:
        stream = self._streams.get(d["request_id"])
        if stream is None:
            return  # closed or aborted streams: the terminal delta of an abort lands here
        if d["prompt_logprobs"] is not None:
            stream.prompt_logprobs = (stream.prompt_logprobs or []) + m.prompt_logprobs_from_wire(d["prompt_logprobs"])
        out = m.output_from_dict(d, stream.prompt, stream.prompt_token_ids,
                                 None if stream.prompt_logprobs is None else list(stream.prompt_logprobs))
        stream.put(out)

    def _mark_dead(self, reason: str, log_error: bool = True) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        if log_error:
            log.error("engine core dead: %s; failing %d in-flight request(s)", reason, len(self._streams))
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(f"the engine core died: {reason}"))
        for fut in list(self._stats_waiters.values()):
            try:
                fut.set_exception(EngineDeadError(f"the engine core died: {reason}"))
            except concurrent.futures.InvalidStateError:
                pass


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the engine process group (it runs in a session of its own) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _kill_and_clean(proc: subprocess.Popen, ipc_dir: str) -> None:
    _kill(proc)
    shutil.rmtree(ipc_dir, ignore_errors=True)
