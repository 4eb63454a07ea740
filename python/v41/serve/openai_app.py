"""The OpenAI-compatible HTTP front end: ``build_app(engine, served_model_name)`` → a FastAPI app.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``POST /tokenize``,
``POST /detokenize``, ``GET /health``, ``GET /metrics`` (docs/serving-api.md "OpenAI HTTP", issue 6 item 3).

The engine is any ``v41.serve.EngineProtocol`` (``EngineClient``, ``v41.AsyncEngine``): ``generate(prompt,
params, request_id, *, priority, cache_salt)`` (an async iterator of *delta* ``RequestOutput``s, the last one
finished), ``abort``,
``tokenizer``, ``cfg``, ``max_model_len``, ``is_running``, ``last_heartbeat_s`` (optional) and ``stats()``
(sync or async). Prompts are tokenized in the front end (BOS + text, like ``v41.engine.prompts.encode_prompt``; chat through
``v41.chat.encode_chat``) and sent as ``{"prompt": text, "prompt_token_ids": ids}``.

This module holds the routes; ``openai_server.py`` the core they share (:class:`OpenAIServer`),
``chat_completions.py`` and ``text_completions.py`` the two generation endpoints, ``generation.py`` the
engine requests of one HTTP request and their lifetime.

Invariants:

* Every string of a request body is valid text (no lone surrogate such as a JSON ``"\\udfff"`` escape), else
  400 naming the field, before anything else (:func:`v41.serve.validation.check_text`).
* Every accepted request gets exactly one terminal response: a JSON body, or an SSE stream that ends with a
  finish chunk or an ``{"error": ...}`` event, then ``data: [DONE]``. Errors map through
  :func:`v41.serve.errors.error_status` (bad input 400, full queue 429, dead engine 503).
* A streaming response starts only once every engine request of it produced its first output, so input
  errors found by the engine (and a full queue) still get their status code instead of a broken stream.
* A client that goes away aborts its engine requests (KF-17): a closed SSE stream closes the engine
  iterators; a non-streaming handler races the generation against ``http.disconnect``. A request that
  finished normally sends no abort.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from . import http_schema as hs
from .chat_completions import ChatCompletions
from .errors import RequestError
from .openai_server import OpenAIServer
from .text_completions import TextCompletions
from .validation import check_text


def build_app(engine: Any, served_model_name: str, *, heartbeat_timeout_s: float = 5.0,
              chat_revision: str | None = None, enable_auto_tool_choice: bool = False) -> FastAPI:
    """The HTTP app serving ``engine`` as model ``served_model_name``. ``heartbeat_timeout_s``: /health
    reports 503 when the engine's ``last_heartbeat_s`` is older than this. ``chat_revision``: chat format
    revision (``v41``, ``v4-original``, ``v4-0731``; default: from the model's architecture).
    ``enable_auto_tool_choice``: allow ``tool_choice: auto`` (``--enable-auto-tool-choice``, as in vLLM)."""
    server = OpenAIServer(engine, served_model_name, heartbeat_timeout_s)
    chat = ChatCompletions(server, chat_revision, enable_auto_tool_choice)
    text = TextCompletions(server)
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
        check_text(body.model_dump(), "")
        return await server.guard(chat.create(body, request))

    @app.post("/v1/completions")
    async def completions(body: hs.CompletionRequest, request: Request) -> Response:
        check_text(body.model_dump(), "")
        return await server.guard(text.create(body, request))

    @app.get("/v1/models")
    async def models() -> hs.ModelList:
        return hs.ModelList(data=[hs.ModelCard(id=served_model_name, root=served_model_name,
                                               max_model_len=server.max_model_len)])

    @app.post("/tokenize")
    async def tokenize(body: hs.TokenizeRequest) -> Response:
        check_text(body.model_dump(), "")
        return await server.guard(_tokenize(server, chat, body))

    @app.post("/detokenize")
    async def detokenize(body: hs.DetokenizeRequest) -> Response:
        check_text(body.model_dump(), "")
        return await server.guard(_detokenize(server, body))

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


async def _tokenize(server: OpenAIServer, chat: ChatCompletions, req: hs.TokenizeRequest) -> Response:
    server.check_model(req.model)
    if req.messages is not None:
        ids, _, _ = chat.encode_chat(req.messages, req.tools, None, req.reasoning_effort,
                                     req.chat_template_kwargs, None)
    elif req.prompt is not None:
        ids = server.encode_text(req.prompt) if req.add_special_tokens else \
            server.tokenizer.encode(req.prompt, add_special_tokens=False).ids
    else:
        raise RequestError("give prompt or messages", "prompt")
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len})


async def _detokenize(server: OpenAIServer, req: hs.DetokenizeRequest) -> Response:
    server.check_model(req.model)
    vocab = server.cfg.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"tokens contains {bad[0]}, outside the vocabulary [0, {vocab})", "tokens")
    text = server.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)
    return JSONResponse({"prompt": text})
