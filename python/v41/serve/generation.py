"""The engine requests of one HTTP request: :class:`Generation` merges their streams; :class:`EventStream`,
:func:`unless_disconnected` and :func:`prime_stream` tie their lifetime to the client's (KF-17)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine.params import CompletionOutput, RequestOutput, SamplingParams
from ..engine.spec_stats import SpecDecodeStats
from . import http_schema as hs
from .errors import ClientDisconnected
from .metrics import ServerMetrics

log = logging.getLogger("v41.serve")


class Generation:
    """The engine requests of one HTTP request (one per prompt, each with ``n`` completions), merged into one
    stream of ``(prompt index, delta RequestOutput)``. Each engine stream is pumped by a task of its own;
    :meth:`close` cancels the pumps, which closes the engine streams of unfinished requests (= abort).
    ``options``: keyword arguments of every ``engine.generate`` call (priority, cache_salt)."""

    def __init__(self, engine: Any, metrics: ServerMetrics, subs: list[tuple[str, dict]], params: SamplingParams,
                 arrival_s: float, options: dict):
        self.engine = engine
        self._options = options
        self.request_ids = [rid for rid, _ in subs]
        self.prompt_ids = [p["prompt_token_ids"] for _, p in subs]
        self.cached_tokens = [0] * len(subs)
        self._spec: dict[tuple[int, int], SpecDecodeStats] = {}  # (prompt, completion index) → latest counts
        self._trackers = [metrics.track(arrival_s) for _ in subs]
        self._finished = [False] * len(subs)
        self._failed = [False] * len(subs)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: deque = deque()
        self._open = len(subs)
        self._closed = False
        self._unclosable: set[int] = set()
        self._tasks = [asyncio.create_task(self._pump(i, rid, prompt, params))
                       for i, (rid, prompt) in enumerate(subs)]

    async def _pump(self, i: int, rid: str, prompt: dict, params: SamplingParams) -> None:
        stream = None
        try:
            stream = self.engine.generate(prompt, params, request_id=rid, **self._options)
            if inspect.isawaitable(stream):
                stream = await stream
            async for out in stream:
                self._queue.put_nowait((i, out))
            self._queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it
            self._queue.put_nowait((i, e))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
            elif stream is not None:
                self._unclosable.add(i)

    def _take(self, i: int, item: Any) -> tuple[int, RequestOutput] | None:
        if item is None:
            self._open -= 1
            return None
        if isinstance(item, BaseException):
            self._failed[i] = True
            raise item
        self._trackers[i].on_output(item)
        self._finished[i] = self._finished[i] or item.finished
        self.cached_tokens[i] = max(self.cached_tokens[i], item.num_cached_tokens)
        for c in item.outputs:
            if c.spec_decode is not None:  # cumulative: the latest replaces the previous
                self._spec[i, c.index] = c.spec_decode
        return i, item

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next delta of any prompt; None when every request has finished. Raises what the engine
        raised (ValueError, QueueFullError, EngineDeadError)."""
        if self._buffer:
            return self._buffer.popleft()
        while self._open:
            got = self._take(*await self._queue.get())
            if got is not None:
                return got
        return None

    async def prime(self) -> None:
        """Wait until every request produced its first output (or failed: raises)."""
        pending = set(range(len(self.request_ids)))
        while pending and self._open:
            i, item = await self._queue.get()
            pending.discard(i)
            got = self._take(i, item)
            if got is not None:
                self._buffer.append(got)

    async def drain(self, request: Request, choice: Callable[[int, RequestOutput, CompletionOutput], Any]) -> None:
        """Non-streamed replies: feed every completion delta to ``choice(prompt index, output, completion)`` (an
        object with ``done`` and ``feed(completion)``) until every request finished, then close. Raises
        ClientDisconnected (the requests aborted) when the client goes away first."""

        async def consume() -> None:
            while (item := await self.next()) is not None:
                p, out = item
                for c in out.outputs:
                    st = choice(p, out, c)
                    if not st.done:
                        st.feed(c)

        try:
            await unless_disconnected(request, consume())
        finally:
            await self.close()

    async def close(self) -> None:
        """End the generation: unfinished requests are aborted (their streams closed); idempotent."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        unfinished = [i for i in range(len(self._tasks)) if not (self._finished[i] or self._failed[i])]
        for i in unfinished:
            self._trackers[i].on_abandoned()
        # Shielded: the SSE task may itself be under cancellation when it closes us.
        await asyncio.shield(self._reap(unfinished))

    async def _reap(self, unfinished: list[int]) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for i in unfinished:
            if i in self._unclosable:  # no aclose: abort explicitly
                try:
                    await self.engine.abort(self.request_ids[i])
                except Exception:  # noqa: BLE001 - the engine may be gone already
                    log.debug("abort of %s failed", self.request_ids[i], exc_info=True)

    def usage(self, choices) -> hs.Usage:
        """Token counts of the prompts and of ``choices`` (chat or text completion states), and the
        speculative-decoding counts of every completion so far (None when the engine reported none)."""
        prompt = sum(len(ids) for ids in self.prompt_ids)
        completion = sum(len(st.ids) for st in choices)
        reasoning = sum(getattr(st, "reasoning_tokens", 0) for st in choices)
        spec = None
        if self._spec:
            total = SpecDecodeStats()
            for stats in self._spec.values():
                total.merge(stats)
            spec = hs.SpecDecodeUsage(**total.to_dict())
        return hs.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                        prompt_tokens_details=hs.PromptTokensDetails(cached_tokens=sum(self.cached_tokens)),
                        completion_tokens_details=hs.CompletionTokensDetails(reasoning_tokens=reasoning),
                        spec_decode=spec)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro) -> Any:
    """Run ``coro``; if the client disconnects first, cancel it and raise ClientDisconnected (KF-17)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watch.cancel()
    if task.cancelled() and watch.done():
        raise ClientDisconnected()
    return task.result()


async def prime_stream(gen: Generation, request: Request) -> None:
    """Wait for every engine request's first output, so errors still get their status code; on failure
    or disconnect the generation is closed (its requests aborted)."""
    try:
        await unless_disconnected(request, gen.prime())
    except BaseException:
        await gen.close()
        raise


class EventStream(StreamingResponse):
    """An SSE response: the body's ``events``, then one ``{"error": ...}`` event (``error_event(exc)``) if they
    raised, then ``data: [DONE]`` — the stream's one terminal event. It always closes its events and its
    generation when it ends, also when the client went away mid-stream (Starlette cancels the sending task
    then, leaving the iterator suspended) or before the first event (the iterator never started, so its own
    ``finally`` never runs)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], gen: Generation, error_event: Callable[[BaseException], str]):
        super().__init__(_framed(events, gen, error_event),
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                await self.gen.close()


async def _framed(events: AsyncIterator[str], gen: Generation,
                  error_event: Callable[[BaseException], str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - the stream's one terminal event
        yield error_event(e)
    finally:
        await gen.close()
    yield "data: [DONE]\n\n"
