"""The OpenAI-compatible HTTP front end: ``build_app(engine, served_model_name)`` → a FastAPI app.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``POST /tokenize``,
``POST /detokenize``, ``GET /health``, ``GET /metrics`` (serving-api.md "OpenAI HTTP", issue 6 item 3).

The engine is any ``v41.serve.EngineProtocol`` (``EngineClient``, ``v41.AsyncEngine``): ``generate(prompt,
params, request_id)`` (an async iterator of *delta* ``RequestOutput``s, the last one finished), ``abort``,
``tokenizer``, ``cfg``, ``max_model_len``, ``is_running``, ``last_heartbeat_s`` (optional) and ``stats()``
(sync or async). Prompts are tokenized here (BOS + text, like ``v41.engine.llm.encode_prompt``; chat through
``v41.chat.encode_chat``) and sent as ``{"prompt": text, "prompt_token_ids": ids}``.

Invariants:

* Every accepted request gets exactly one terminal response: a JSON body, or an SSE stream that ends with a
  finish chunk or an ``{"error": ...}`` event, then ``data: [DONE]``. Errors map through
  :func:`v41.serve.errors.error_status` (bad input 400, full queue 429, dead engine 503).
* A streaming response starts only once every engine request of it produced its first output, so input
  errors found by the engine (and a full queue) still get their status code instead of a broken stream.
* A client that goes away aborts its engine requests (KF-17): a closed SSE stream closes the engine
  iterators; a non-streaming handler races the generation against ``http.disconnect``. A request that
  finished normally sends no abort.
* Tool choice: ``none`` renders and parses no tools; ``auto`` and ``required`` render and parse all; a named
  function renders only that tool. There is no constrained decoding, so ``required``/named are best effort.
* Chat output is parsed from token ids (``v41.chat.OutputParser``); the token that stopped generation (EOS
  or a stop token id) is not fed to the parser. Stop *strings* are matched by the engine on the raw text
  and end generation, but the parser sees the tokens that held them (known limitation).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.params import CompletionOutput, RequestOutput, SamplingParams, check_request_options
from . import http_schema as hs
from .errors import (ClientDisconnected, ModelNotFoundError, RequestError, error_status, openai_error_body)
from .metrics import ServerMetrics

log = logging.getLogger("v41.serve")

_EFFORT_ALIASES = {"minimal": "low", "medium": "high"}  # OpenAI names the V4.1 encoder does not know
_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}


# ------------------------------------------------------------------------------------------------ the app


def build_app(engine: Any, served_model_name: str, *, heartbeat_timeout_s: float = 5.0,
              chat_revision: str | None = None) -> FastAPI:
    """The HTTP app serving ``engine`` as model ``served_model_name``. ``heartbeat_timeout_s``: /health
    reports 503 when the engine's ``last_heartbeat_s`` is older than this. ``chat_revision``: chat format
    revision (``v41``, ``v4-original``, ``v4-0731``; default: from the model's architecture)."""
    server = OpenAIServer(engine, served_model_name, heartbeat_timeout_s, chat_revision)
    app = FastAPI(title="v41 OpenAI-compatible server")
    app.state.server = server

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts, param = [], None
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            param = param or loc or None
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return server.error_response(RequestError("; ".join(parts) or "invalid request", param))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return server.error_response(exc)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: hs.ChatCompletionRequest, request: Request) -> Response:
        return await server.guard(server.chat(body, request))

    @app.post("/v1/completions")
    async def completions(body: hs.CompletionRequest, request: Request) -> Response:
        return await server.guard(server.completions(body, request))

    @app.get("/v1/models")
    async def models() -> hs.ModelList:
        return hs.ModelList(data=[hs.ModelCard(id=served_model_name, root=served_model_name,
                                               max_model_len=server.max_model_len)])

    @app.post("/tokenize")
    async def tokenize(body: hs.TokenizeRequest) -> Response:
        return await server.guard(server.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: hs.DetokenizeRequest) -> Response:
        return await server.guard(server.detokenize(body))

    @app.get("/health")
    async def health() -> Response:
        alive, why = server.engine_alive()
        if alive:
            return Response(status_code=200)
        return JSONResponse({"error": {"message": why, "type": "service_unavailable", "param": None,
                                       "code": "engine_dead"}}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = await server.scrape()
        return Response(body, media_type=content_type)

    return app


class OpenAIServer:
    """The state behind the routes: the engine, the served name, the metrics."""

    def __init__(self, engine: Any, served_model_name: str, heartbeat_timeout_s: float,
                 chat_revision: str | None = None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._chat_revision = chat_revision
        self.metrics = ServerMetrics()

    # -- engine accessors ----------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def cfg(self):
        return self.engine.cfg

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def chat_revision(self) -> str:
        """The chat format revision (v41-architecture.md §7.1): given, else the model's default."""
        if self._chat_revision is None:
            by_type = _chat_api().formats.DEFAULT_REVISION_BY_MODEL_TYPE
            self._chat_revision = by_type["deepseek_v41" if self.cfg.is_v41 else "deepseek_v4"]
        return self._chat_revision

    def engine_alive(self) -> tuple[bool, str]:
        """(alive, why not): running, and the last heartbeat (when the engine reports one) is fresh."""
        running = getattr(self.engine, "is_running", True)
        if callable(running):
            running = running()
        if not running:
            return False, "the engine is not running"
        beat = getattr(self.engine, "last_heartbeat_s", None)
        if callable(beat):
            beat = beat()
        if beat is not None and time.monotonic() - beat > self.heartbeat_timeout_s:
            return False, f"no engine heartbeat for {time.monotonic() - beat:.1f} s"
        return True, ""

    async def stats(self) -> dict | None:
        """The engine's ``stats()`` (sync or async); None if it has none."""
        fn = getattr(self.engine, "stats", None)
        if fn is None:
            return None
        res = fn()
        return await res if inspect.isawaitable(res) else res

    async def scrape(self) -> tuple[bytes, str]:
        alive, _ = self.engine_alive()
        stats = None
        if alive:
            try:
                stats = await self.stats()
            except Exception:  # noqa: BLE001 - a scrape must answer even if the engine just died
                log.warning("engine stats failed during a metrics scrape", exc_info=True)
                alive = False
        self.metrics.update_engine(stats, alive)
        return self.metrics.render()

    # -- errors -------------------------------------------------------------------------------------------
    def error_response(self, exc: BaseException) -> JSONResponse:
        status = error_status(exc)
        self.metrics.record_error(status.http_status)
        if status.http_status >= 500:
            log.error("request failed: %s", exc, exc_info=status.http_status == 500)
        return JSONResponse(openai_error_body(exc, status), status_code=status.http_status)

    async def guard(self, coro) -> Response:
        try:
            return await coro
        except ClientDisconnected:
            self.metrics.record_error(499)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - every error becomes one mapped response
            return self.error_response(e)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ModelNotFoundError(model, self.served_model_name)

    # -- prompts and parameters ------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """BOS + the text's tokens ([] for ""), as ``v41.engine.llm.encode_prompt``."""
        if not text:
            return []
        return [self.cfg.bos_token_id] + self.tokenizer.encode(text, add_special_tokens=False).ids

    def check_prompt(self, ids: list[int], params: SamplingParams, what: str) -> None:
        mml = self.max_model_len
        if not ids:
            raise RequestError(f"{what} is empty: give at least one token", what)
        if len(ids) >= mml:
            raise RequestError(f"{what} has {len(ids)} tokens; max_model_len is {mml}", what)
        if params.max_tokens is not None and len(ids) + params.max_tokens > mml:
            raise RequestError(f"{what} ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                               f"max_model_len ({mml})", "max_tokens")

    def sampling_params(self, req: hs.SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams of a request, validated (ValueError naming the field → 400)."""
        bias = None
        if req.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError:
                raise RequestError("logit_bias keys must be token ids", "logit_bias") from None
        sp = SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens, logit_bias=bias)
        try:
            sp.validate(self.cfg.vocab_size)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise RequestError(str(e), field if field in _SAMPLING_FIELDS else None) from None
        return sp

    def start(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
              arrival_s: float, req: hs.SamplingFields) -> Generation:
        """Submit one engine request per prompt (ids ``request_id``, or ``request_id-i`` for several), with the
        request's ``priority`` and ``cache_salt`` (RequestError naming a bad one → 400)."""
        try:
            check_request_options(req.priority, req.cache_salt)
        except ValueError as e:
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None
        subs = [(request_id if len(prompts) == 1 else f"{request_id}-{i}", {"prompt": text,
                 "prompt_token_ids": ids}) for i, (text, ids) in enumerate(prompts)]
        return Generation(self, subs, params, arrival_s, {"priority": req.priority,
                                                            "cache_salt": req.cache_salt or None})

    # -- chat -----------------------------------------------------------------------------------------------
    def encode_chat(self, messages: list[hs.ChatMessageIn], tools: list[hs.ToolDefinition] | None,
                    tool_choice: Any, effort: str | int | None, template_kwargs: dict | None,
                    thinking_field: bool | dict | None,
                    response_format: dict | None = None) -> tuple[list[int], bool, list[dict] | None]:
        """Prompt ids, effective thinking flag and the tools to render/parse (None: no tools). Raises
        RequestError (KF-16: no messages, an empty user message; malformed tool calls; bad tool_choice)
        and the encoder's ValueError. ``response_format`` is rendered into the prompt (no constrained
        decoding)."""
        if not messages:
            raise RequestError("messages is empty: give at least one message", "messages")
        msgs = []
        for i, m in enumerate(messages):
            if m.role == "user" and _is_empty_content(m.content):
                raise RequestError(f"messages[{i}].content is empty: a user message needs text",
                                   f"messages[{i}].content")
            for j, call in enumerate(m.tool_calls or []):
                try:
                    args = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    args = None
                if not isinstance(args, dict):
                    raise RequestError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object",
                                       f"messages[{i}].tool_calls")
            msgs.append(m.model_dump(exclude_none=True))
        tool_dicts = _select_tools([t.model_dump(exclude_none=True) for t in tools or []], tool_choice)
        thinking, effort = _resolve_thinking(template_kwargs, thinking_field, effort)
        if response_format is not None and response_format.get("type") == "text":
            response_format = None
        enc = _chat_api().encode_chat(self.tokenizer, msgs, tools=tool_dicts, thinking=thinking,
                                      reasoning_effort=effort, revision=self.chat_revision,
                                      response_format=response_format)
        return list(enc.token_ids), enc.thinking, tool_dicts

    async def chat(self, req: hs.ChatCompletionRequest, request: Request) -> Response:
        arrival_s = time.monotonic()
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        top_n = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sp = self.sampling_params(req, max_tokens, top_n if req.logprobs else None)
        ids, thinking, tools = self.encode_chat(req.messages, req.tools, req.tool_choice, req.reasoning_effort,
                                                req.chat_template_kwargs, req.thinking, req.response_format)
        self.check_prompt(ids, sp, "messages")
        chat = _chat_api()
        think_close = self.tokenizer.token_to_id("</think>")

        def new_choice(index: int) -> ChatChoice:
            parser = chat.OutputParser(self.tokenizer, thinking=thinking, tools=tools, prompt_ids=ids,
                                       revision=self.chat_revision)
            return ChatChoice(index, parser, think_close)

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = self.start(rid, [(None, ids)], sp, arrival_s, req)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            await self._prime(gen, request)
            return _EventStream(self._chat_events(gen, rid, sp, new_choice, top_n, include_usage), gen)
        choices: dict[int, ChatChoice] = {}

        async def consume() -> None:
            while (item := await gen.next()) is not None:
                for c in item[1].outputs:
                    st = choices.get(c.index) or choices.setdefault(c.index, new_choice(c.index))
                    if not st.done:
                        st.feed(c)

        try:
            await _unless_disconnected(request, consume())
        finally:
            await gen.close()
        decode = self.decode_token
        out = [hs.ChatChoice(index=i, message=st.message(), finish_reason=st.openai_finish_reason,
                             stop_reason=st.stop_reason,
                             logprobs=hs.ChatLogprobs(content=hs.chat_logprobs(st.ids, st.lps, top_n, decode))
                             if sp.logprobs is not None else None)
               for i, st in sorted(choices.items())]
        resp = hs.ChatCompletionResponse(id=rid, model=self.served_model_name, choices=out,
                                         usage=self.usage(gen, choices.values()))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _chat_events(self, gen: Generation, rid: str, sp: SamplingParams, new_choice, top_n: int,
                           include_usage: bool) -> AsyncIterator[str]:
        created, model = int(time.time()), self.served_model_name
        choices: dict[int, ChatChoice] = {}

        def event(choice: hs.ChatChunkChoice | None, usage: hs.Usage | None = None) -> str:
            chunk = hs.ChatCompletionChunk(id=rid, created=created, model=model,
                                           choices=[] if choice is None else [choice], usage=usage)
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        try:
            for i in range(sp.n):
                yield event(hs.ChatChunkChoice(index=i, delta=hs.ChatDelta(role="assistant", content="")))
            while (item := await gen.next()) is not None:
                for c in item[1].outputs:
                    st = choices.get(c.index) or choices.setdefault(c.index, new_choice(c.index))
                    if st.done:
                        continue
                    reasoning, content, tool_deltas = st.feed(c)
                    lp = None
                    if sp.logprobs is not None and c.logprobs:
                        lp = hs.ChatLogprobs(content=hs.chat_logprobs(list(c.token_ids), c.logprobs, top_n,
                                                                      self.decode_token))
                    if reasoning or content or tool_deltas or lp is not None:
                        yield event(hs.ChatChunkChoice(index=c.index, logprobs=lp, delta=hs.ChatDelta(
                            reasoning_content=reasoning or None, content=content or None,
                            tool_calls=tool_deltas or None)))
                    if st.done:
                        yield event(hs.ChatChunkChoice(index=c.index, delta=hs.ChatDelta(),
                                                       finish_reason=st.openai_finish_reason,
                                                       stop_reason=st.stop_reason))
            if include_usage:
                yield event(None, self.usage(gen, choices.values()))
        except Exception as e:  # noqa: BLE001 - the stream's one terminal event
            yield self.error_event(e)
        finally:
            await gen.close()
        yield "data: [DONE]\n\n"

    # -- completions -------------------------------------------------------------------------------------
    def completion_prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
        """(text or None, ids) per prompt; raises RequestError naming an empty prompt (KF-16)."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty: give at least one token", "prompt")
            return [(prompt, self.encode_text(prompt))]
        if not prompt:
            raise RequestError("prompt is empty: an empty list holds no tokens", "prompt")
        if all(isinstance(t, int) for t in prompt):
            return [(None, list(prompt))]
        out = []
        for i, p in enumerate(prompt):
            if not p:
                raise RequestError(f"prompt[{i}] is empty: give at least one token", "prompt")
            out.append((p, self.encode_text(p)) if isinstance(p, str) else (None, list(p)))
        return out

    async def completions(self, req: hs.CompletionRequest, request: Request) -> Response:
        arrival_s = time.monotonic()
        self.check_model(req.model)
        if req.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            raise RequestError("response_format is supported by /v1/chat/completions only", "response_format")
        prompts = self.completion_prompts(req.prompt)
        echo_lp = req.logprobs if req.echo and req.logprobs is not None else None
        sp = self.sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs=echo_lp)
        for i, (_, ids) in enumerate(prompts):
            self.check_prompt(ids, sp, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        rid = f"cmpl-{uuid.uuid4().hex}"
        gen = self.start(rid, prompts, sp, arrival_s, req)
        choices: dict[int, CompletionChoice] = {}

        def choice(p: int, out: RequestOutput, c: CompletionOutput) -> CompletionChoice:
            key = p * sp.n + c.index
            if key not in choices:
                choices[key] = CompletionChoice(key, self.echo(prompts[p], out, sp) if req.echo else None)
            return choices[key]

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            await self._prime(gen, request)
            return _EventStream(self._completion_events(gen, rid, sp, choices, choice, include_usage), gen)

        async def consume() -> None:
            while (item := await gen.next()) is not None:
                p, out = item
                for c in out.outputs:
                    st = choice(p, out, c)
                    if not st.done:
                        st.feed(c)

        try:
            await _unless_disconnected(request, consume())
        finally:
            await gen.close()
        out = []
        for k, st in sorted(choices.items()):
            lp = None
            if sp.logprobs is not None:
                lp = _join_logprobs(st.echo_logprobs(sp.logprobs, self.decode_token),
                                    st.new_logprobs(st.ids, st.lps, sp.logprobs, self.decode_token))
            out.append(hs.CompletionChoice(index=k, text=st.echo_text + st.text, logprobs=lp,
                                           finish_reason=st.finish_reason, stop_reason=st.stop_reason))
        resp = hs.CompletionResponse(id=rid, model=self.served_model_name, choices=out,
                                     usage=self.usage(gen, choices.values()))
        return Response(resp.model_dump_json(), media_type="application/json")

    def echo(self, prompt: tuple[str | None, list[int]], out: RequestOutput,
             sp: SamplingParams) -> tuple[str, list[int], list | None]:
        """(echo text, echo token ids, echo logprob entries or None) of one prompt; the BOS this server added
        to a text prompt is not echoed."""
        text, ids = prompt
        skip = 1 if text is not None else 0
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
        entries = None if out.prompt_logprobs is None else list(out.prompt_logprobs)[skip:]
        return text, ids[skip:], entries

    async def _completion_events(self, gen: Generation, rid: str, sp: SamplingParams,
                                 choices: dict[int, CompletionChoice], choice,
                                 include_usage: bool) -> AsyncIterator[str]:
        created, model = int(time.time()), self.served_model_name

        def event(c: hs.CompletionChoice | None, usage: hs.Usage | None = None) -> str:
            chunk = hs.CompletionResponse(id=rid, created=created, model=model, choices=[] if c is None else [c],
                                          usage=usage)
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        try:
            while (item := await gen.next()) is not None:
                p, out = item
                for c in out.outputs:
                    st = choice(p, out, c)
                    if st.done:
                        continue
                    first = not st.started
                    text = st.feed(c)
                    lp = None
                    if sp.logprobs is not None:
                        lp = st.new_logprobs(list(c.token_ids), c.logprobs or [], sp.logprobs, self.decode_token)
                        if first:
                            lp = _join_logprobs(st.echo_logprobs(sp.logprobs, self.decode_token), lp)
                    if first:
                        text = st.echo_text + text
                    if text or (lp is not None and lp.tokens) or st.done:
                        yield event(hs.CompletionChoice(index=st.index, text=text, logprobs=lp,
                                                        finish_reason=st.finish_reason, stop_reason=st.stop_reason))
            if include_usage:
                yield event(None, self.usage(gen, choices.values()))
        except Exception as e:  # noqa: BLE001 - the stream's one terminal event
            yield self.error_event(e)
        finally:
            await gen.close()
        yield "data: [DONE]\n\n"

    # -- shared pieces -------------------------------------------------------------------------------------
    def decode_token(self, tok: int) -> str:
        return self.tokenizer.decode([tok], skip_special_tokens=False)

    def usage(self, gen: Generation, choices) -> hs.Usage:
        prompt = sum(len(ids) for ids in gen.prompt_ids)
        completion = sum(len(st.ids) for st in choices)
        reasoning = sum(getattr(st, "reasoning_tokens", 0) for st in choices)
        return hs.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                        prompt_tokens_details=hs.PromptTokensDetails(cached_tokens=sum(gen.cached_tokens)),
                        completion_tokens_details=hs.CompletionTokensDetails(reasoning_tokens=reasoning))

    def error_event(self, exc: BaseException) -> str:
        status = error_status(exc)
        self.metrics.record_error(status.http_status)
        log.log(logging.ERROR if status.http_status >= 500 else logging.INFO, "stream failed: %s", exc,
                exc_info=status.http_status == 500)
        return f"data: {json.dumps(openai_error_body(exc, status))}\n\n"

    async def _prime(self, gen: Generation, request: Request) -> None:
        """Wait for every engine request's first output, so errors still get their status code; on failure
        or disconnect the generation is closed (its requests aborted)."""
        try:
            await _unless_disconnected(request, gen.prime())
        except BaseException:
            await gen.close()
            raise

    # -- tokenize ----------------------------------------------------------------------------------------
    async def tokenize(self, req: hs.TokenizeRequest) -> Response:
        self.check_model(req.model)
        if req.messages is not None:
            ids, _, _ = self.encode_chat(req.messages, req.tools, None, req.reasoning_effort,
                                         req.chat_template_kwargs, None)
        elif req.prompt is not None:
            ids = self.encode_text(req.prompt) if req.add_special_tokens else \
                self.tokenizer.encode(req.prompt, add_special_tokens=False).ids
        else:
            raise RequestError("give prompt or messages", "prompt")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def detokenize(self, req: hs.DetokenizeRequest) -> Response:
        self.check_model(req.model)
        vocab = self.cfg.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"tokens contains {bad[0]}, outside the vocabulary [0, {vocab})", "tokens")
        text = self.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)
        return JSONResponse({"prompt": text})


# ------------------------------------------------------------------------------------- engine requests


class Generation:
    """The engine requests of one HTTP request (one per prompt, each with ``n`` completions), merged into one
    stream of ``(prompt index, delta RequestOutput)``. Each engine stream is pumped by a task of its own;
    :meth:`close` cancels the pumps, which closes the engine streams of unfinished requests (= abort).
    ``options``: keyword arguments of every ``engine.generate`` call (priority, cache_salt)."""

    def __init__(self, server: OpenAIServer, subs: list[tuple[str, dict]], params: SamplingParams,
                 arrival_s: float, options: dict):
        self.engine = server.engine
        self._options = options
        self.request_ids = [rid for rid, _ in subs]
        self.prompt_ids = [p["prompt_token_ids"] for _, p in subs]
        self.cached_tokens = [0] * len(subs)
        self._trackers = [server.metrics.track(arrival_s) for _ in subs]
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


# ---------------------------------------------------------------------------------------- choice states


class ChatChoice:
    """One chat completion being parsed (``v41.chat.OutputParser``): its ids, logprobs and final result."""

    def __init__(self, index: int, parser: Any, think_close_id: int | None):
        self.index = index
        self.parser = parser
        self.think_close_id = think_close_id
        self.ids: list[int] = []
        self.lps: list = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.result: Any = None  # v41.chat.ParserResult once finished

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, c: CompletionOutput) -> tuple[str, str, list[dict]]:
        """Account one delta; returns the new (reasoning, content, OpenAI tool-call deltas) to stream."""
        ids = list(c.token_ids)
        self.ids += ids
        if c.logprobs:
            self.lps += c.logprobs
        if c.finish_reason == "stop" and ids and not isinstance(c.stop_reason, str):
            ids = ids[:-1]  # the EOS / stop token that ended generation is no text
        deltas = [self.parser.feed(ids)] if ids else []
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
            self.result = self.parser.finish()
            deltas.append(self.result.final_delta)  # what the parser held back until the end
        return ("".join(d.reasoning_delta for d in deltas), "".join(d.content_delta for d in deltas),
                [t.to_openai() for d in deltas for t in d.tool_call_deltas])

    @property
    def tool_calls(self) -> list[dict]:
        return self.result.tool_calls if self.result is not None else []

    @property
    def openai_finish_reason(self) -> str | None:
        return self.result.finish_reason(self.finish_reason) if self.result is not None else self.finish_reason

    @property
    def reasoning_tokens(self) -> int:
        """Generated tokens before ``</think>`` (all of them if reasoning never closed); 0 without reasoning."""
        if self.result is None or not self.result.reasoning_content:
            return 0
        if self.think_close_id is not None and self.think_close_id in self.ids:
            return self.ids.index(self.think_close_id)
        return len(self.ids)

    def message(self) -> hs.ChatMessageOut:
        calls = [hs.ToolCallOut(id=c["id"], function=hs.ToolCallFunctionOut(
            name=c["function"]["name"], arguments=c["function"]["arguments"])) for c in self.tool_calls]
        content = self.result.content
        return hs.ChatMessageOut(content=None if calls and not content else content,
                                 reasoning_content=self.result.reasoning_content, tool_calls=calls)


class CompletionChoice:
    """One legacy completion: its text, ids, logprobs, and the echoed prompt (text, ids, logprob entries)."""

    def __init__(self, index: int, echo: tuple[str, list[int], list | None] | None):
        self.index = index
        self.echo_text, self.echo_ids, self.echo_entries = echo or ("", [], None)
        self.text = ""
        self.ids: list[int] = []
        self.lps: list = []
        self.started = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._offset = len(self.echo_text)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, c: CompletionOutput) -> str:
        self.started = True
        self.text += c.text
        self.ids += c.token_ids
        if c.logprobs:
            self.lps += c.logprobs
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
        return c.text

    def echo_logprobs(self, n: int, decode) -> hs.CompletionLogprobs | None:
        if not self.echo_ids or self.echo_entries is None:
            return None
        return hs.completion_logprobs(self.echo_ids, self.echo_entries, n, decode)

    def new_logprobs(self, ids: list[int], entries: list, n: int, decode) -> hs.CompletionLogprobs:
        lp = hs.completion_logprobs(ids, entries, n, decode, text_offset_0=self._offset)
        self._offset += sum(len(t) for t in lp.tokens)
        return lp


# ------------------------------------------------------------------------------------------------ helpers


def _chat_api():
    try:
        from .. import chat
    except ImportError as e:
        raise NotImplementedError(f"chat is unavailable: v41.chat does not import ({e})") from e
    return chat


def _is_empty_content(content: Any) -> bool:
    if content is None or content == "":
        return True
    if isinstance(content, list):
        return all(p.get("type") == "text" and not p.get("text") for p in content)
    return False


def _select_tools(tools: list[dict], tool_choice: Any) -> list[dict] | None:
    """The tools to render and parse for ``tool_choice`` (module docstring); RequestError when it is
    inconsistent with ``tools``."""
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise RequestError("tools holds two functions with the same name", "tools")
    if isinstance(tool_choice, hs.NamedToolChoice):
        name = tool_choice.function.name
        if name not in names:
            raise RequestError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return [t for t in tools if t["function"]["name"] == name]
    if tool_choice == "required" and not tools:
        raise RequestError("tool_choice 'required' needs tools", "tool_choice")
    if tool_choice == "none" or not tools:
        return None
    return tools


def _resolve_thinking(kwargs: dict | None, thinking_field: bool | dict | None,
                      effort: str | int | None) -> tuple[bool | None, str | int | None]:
    """The effective thinking flag (KF-04: the parser starts from it) and the encoder's reasoning effort.
    ``chat_template_kwargs.thinking`` / ``enable_thinking``, DeepSeek's ``thinking`` field, and
    ``reasoning_effort: "none"`` (thinking off) decide; None leaves it to the chat format's default."""
    thinking = None
    for key in ("thinking", "enable_thinking"):
        if kwargs and key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise RequestError(f"chat_template_kwargs.{key} must be true or false", "chat_template_kwargs")
            thinking = kwargs[key]
    if isinstance(thinking_field, bool):
        thinking = thinking_field
    elif isinstance(thinking_field, dict):
        kind = thinking_field.get("type")
        if kind not in ("enabled", "disabled"):
            raise RequestError("thinking.type must be 'enabled' or 'disabled'", "thinking")
        thinking = kind == "enabled"
    if isinstance(effort, str):
        effort = effort.strip().lower()
        if effort == "none":
            thinking, effort = False, None
        else:
            effort = _EFFORT_ALIASES.get(effort, effort)
    return thinking, effort


def _join_logprobs(a: hs.CompletionLogprobs | None, b: hs.CompletionLogprobs) -> hs.CompletionLogprobs:
    if a is None:
        return b
    return hs.CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                                 token_logprobs=a.token_logprobs + b.token_logprobs,
                                 tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro) -> Any:
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


class _EventStream(StreamingResponse):
    """An SSE response that always closes its events and its generation when it ends, also when the client
    went away mid-stream (Starlette cancels the sending task then, leaving the iterator suspended) or before
    the first event (the iterator never started, so its own ``finally`` never runs)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], gen: Generation):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                await self.gen.close()
