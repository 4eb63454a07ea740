"""gRPC front end: the ``v41.v1.Engine`` service (``proto/v41/v1/engine.proto``) over an engine.

``serve_grpc(engine, host, port, served_model_name)`` starts a ``grpc.aio`` server with the Engine service,
the standard ``grpc.health.v1.Health`` service and server reflection, and returns it; the caller awaits
``wait_for_termination()`` and calls ``stop(grace)``. ``engine`` is a ``serve.engine_client.EngineProtocol``
(``EngineClient`` or the in-process ``v41.AsyncEngine``).

Invariants: every accepted Generate ends with exactly one ``Complete`` per completion, or with an error status
and nothing after it; a call the client cancels (or whose stream breaks) aborts its request, so its KV blocks
are freed within about one engine step (KF-17); a request that finished normally is never aborted. Health says
SERVING while the engine runs and its heartbeat is fresh, also through a long prefill (KF-18), NOT_SERVING
once it died or wedged — the rule of the HTTP ``/health`` (checked on every Check, every 0.5 s for Watch).

Request bytes that do not decode as the method's message are INVALID_ARGUMENT (not grpc.aio's UNKNOWN).
Errors are mapped by ``serve/errors.py`` (the one table for both front ends): ValueError → INVALID_ARGUMENT,
QueueFullError → RESOURCE_EXHAUSTED, EngineDeadError → UNAVAILABLE, anything else → INTERNAL (logged).
Chat input and ``parse_output`` use ``v41.chat`` like ``chat_completions.py`` does (same revision, thinking and
reasoning-token rules).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..chat import OutputParser, encode_chat
from ..chat.formats import DEFAULT_REVISION_BY_MODEL_TYPE
from ..engine.params import CompletionOutput, RequestOutput, SamplingParams
from ..engine.spec_stats import SpecDecodeStats
from .errors import INTERNAL, error_message, error_status
from .grpc_convert import (Undecodable, json_list, lenient_parser, logprobs_to_proto, sampling_params_from_proto,
                           spec_decode_to_proto)
from .grpc_gen import load as _load_stubs
from .grpc_health import EngineHealth, watch_engine
from .metrics import kv_blocks
from .validation import SUPPORTS_VISION, check_text, engine_max_n, validate_messages, validate_tools

pb2, pb2_grpc = _load_stubs()
log = logging.getLogger("v41.serve.grpc")

SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["Engine"].full_name  # "v41.v1.Engine"
MAX_MESSAGE_BYTES = 64 << 20
_BACKGROUND: set[asyncio.Task] = set()

async def _abort_with(context, exc: BaseException, what: str):
    """End the call with the status of ``exc`` (serve/errors.py); logs our own failures."""
    status = error_status(exc)
    if status is INTERNAL:
        log.error("%s failed", what, exc_info=exc)
    await context.abort(grpc.StatusCode[status.grpc_code], error_message(exc))


def _add_engine_service(servicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as the Engine service, as ``pb2_grpc.add_EngineServicer_to_server`` does but with
    :func:`lenient_parser` as every method's request deserializer."""
    handlers = {}
    for method in pb2.DESCRIPTOR.services_by_name["Engine"].methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name), request_deserializer=lenient_parser(getattr(pb2, method.input_type.name)),
            response_serializer=getattr(pb2, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _guarded(method):
    """A unary RPC whose exceptions become gRPC statuses (``context.abort`` passes through); undecodable
    request bytes end it with INVALID_ARGUMENT."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            await _abort_with(context, e, method.__name__)
    return wrapper


# ---------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class _Chat:
    """A decoded ``ChatInput`` and its encoding."""

    ids: list[int]
    thinking: bool  # effective thinking mode
    tools: list | None
    revision: str


# ---------------------------------------------------------------------------------------------- responses
@dataclass
class _Completion:
    """Server-side record of one completion of a Generate call."""

    index: int
    parser: Any = None  # v41.chat.OutputParser (parse_output)
    result: Any = None  # its v41.chat.ParserResult, once the completion finished
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob, stream=False only
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob, stream=False, index 0 only
    reasoning_tokens: int = 0
    first_token_s: float | None = None
    done: bool = False


class EngineServicer(pb2_grpc.EngineServicer):
    """``v41.v1.Engine`` over an ``EngineProtocol`` engine."""

    def __init__(self, engine, served_model_name: str, chat_revision: str | None = None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.started_s = time.monotonic()
        self._active: set[str] = set()  # request ids of Generate calls in flight
        self._revision = chat_revision

    # -- Generate ----------------------------------------------------------------------------------------
    async def Generate(self, request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        try:
            prompt, chat = self._prompt(request)
            params = sampling_params_from_proto(request.sampling_params)
            params.validate(self.engine.cfg.vocab_size, engine_max_n(self.engine))
            if rid in self._active:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already in flight")
        except ValueError as e:
            await _abort_with(context, e, "Generate")
        self._active.add(rid)
        received_s = time.monotonic()
        states: dict[int, _Completion] = {}
        ended = False  # every completion sent its Complete, or the engine failed the request
        error: Exception | None = None
        try:
            # proto3 cannot tell an empty cache_salt from an unset one: both are the shared namespace.
            stream = self.engine.generate(prompt, params, request_id=rid, priority=request.priority,
                                          cache_salt=request.cache_salt or None)
            async with aclosing(stream) as outputs:
                async for out in outputs:
                    for msg in self._on_output(request, params, chat, out, states, received_s):
                        yield pb2.GenerateResponse(request_id=rid, **msg)
            ended = True
        except Exception as e:  # noqa: BLE001 - every engine error becomes a status, never a hang
            ended, error = True, e
        finally:
            self._active.discard(rid)
            # The client went away mid-stream (KF-17) or the request failed after it was accepted: abort (a
            # no-op for ids the engine no longer knows). Never after a normal finish, a rejection or a death.
            failed = error is not None and not isinstance(error, ValueError) and self.engine.is_running
            if not ended or failed:
                await self._abort_quietly(rid)
        if error is not None:
            await _abort_with(context, error, f"Generate {rid}")

    def _prompt(self, request) -> tuple[str | list[int], _Chat | None]:
        """(prompt for ``engine.generate``, encoded chat or None); ValueError for empty or malformed input."""
        kind = request.WhichOneof("input")
        if kind == "tokens":
            if not request.tokens.ids:
                raise ValueError("the prompt is empty: tokens.ids has no token ids")
            return list(request.tokens.ids), None
        if kind == "text":
            if not request.text:
                raise ValueError("the prompt is empty: text is an empty string")
            return request.text, None
        if kind == "chat":
            chat = self._encode_chat(request.chat)
            return chat.ids, chat
        raise ValueError("GenerateRequest needs an input: tokens, text or chat")

    @property
    def chat_revision(self) -> str:
        """The chat format revision of the served model (as chat_completions.py's)."""
        if self._revision is None:
            self._revision = DEFAULT_REVISION_BY_MODEL_TYPE[self.engine.cfg.arch]
        return self._revision

    def _encode_chat(self, c) -> _Chat:
        messages = json_list(c.messages_json, "messages_json")
        check_text(messages, "chat.messages_json")  # JSON escapes may hold lone surrogates; proto strings cannot
        validate_messages(messages, "chat.messages_json")  # the checks of the HTTP chat route
        tools = json_list(c.tools_json, "tools_json") or None
        check_text(tools, "chat.tools_json")
        validate_tools(tools, "chat.tools_json")
        effort = c.reasoning_effort if c.HasField("reasoning_effort") else None
        if effort is not None and effort.isdigit():
            effort = int(effort)
        try:
            enc = encode_chat(self.engine.tokenizer, messages, tools=tools,
                              thinking=c.thinking if c.HasField("thinking") else None,
                              reasoning_effort=effort, revision=self.chat_revision)
        except (TypeError, KeyError, AttributeError) as e:  # a JSON shape the encoder does not expect
            raise ValueError(f"malformed chat input: {type(e).__name__}: {e}") from None
        if not enc.token_ids:
            raise ValueError("the chat prompt encodes to no tokens")
        return _Chat(list(enc.token_ids), enc.thinking, tools, self.chat_revision)

    def _on_output(self, request, params: SamplingParams, chat: _Chat | None, out: RequestOutput,
                   states: dict[int, _Completion], received_s: float):
        """Response fields (``chunk=`` / ``complete=``) for one engine delta."""
        now = time.monotonic()
        for c in out.outputs:
            st = states.get(c.index)
            if st is None:
                st = states[c.index] = _Completion(c.index, parser=self._parser(request, chat, out))
            if st.done:
                continue
            new_ids = list(c.token_ids)
            st.token_ids += new_ids
            st.text.append(c.text)
            if new_ids and st.first_token_s is None:
                st.first_token_s = now
            lps = logprobs_to_proto(c.logprobs, new_ids, params.logprobs or 0) if c.logprobs else []
            prompt_lps = []
            if c.index == 0 and len(st.token_ids) == len(new_ids) and out.prompt_logprobs:
                prompt_lps = logprobs_to_proto(out.prompt_logprobs, out.prompt_token_ids,
                                                params.prompt_logprobs or 0)
            deltas = self._parse(st, c, new_ids)
            reasoning = "".join(d.reasoning_delta for d in deltas)
            content = "".join(d.content_delta for d in deltas)
            tool_deltas = [pb2.ToolCallDelta(index=t.index, id=t.id or "", name=t.name or "",
                                             arguments_delta=t.arguments)
                           for d in deltas for t in d.tool_call_deltas]
            if request.stream:
                if new_ids or c.text or prompt_lps or reasoning or content or tool_deltas:
                    yield dict(chunk=pb2.Chunk(
                        token_ids=new_ids, text=c.text, reasoning_delta=reasoning, content_delta=content,
                        tool_call_deltas=tool_deltas, logprobs=lps, usage=self._usage(out, st),
                        index=c.index, prompt_logprobs=prompt_lps))
            else:
                st.logprobs += lps
                st.prompt_logprobs += prompt_lps
            if c.finish_reason is not None:
                st.done = True
                yield dict(complete=self._complete(request, out, c, st, received_s, now))

    def _parser(self, request, chat: _Chat | None, out: RequestOutput):
        if not request.parse_output:
            return None
        return OutputParser(
            self.engine.tokenizer, thinking=chat.thinking if chat else None, tools=chat.tools if chat else None,
            prompt_ids=list(out.prompt_token_ids), revision=self.chat_revision)

    def _parse(self, st: _Completion, c: CompletionOutput, new_ids: list[int]) -> list:
        """Parser deltas of the new tokens, plus the parser's final delta when the completion ends."""
        if st.parser is None:
            return []
        deltas, result = st.parser.feed_engine_output(new_ids, c.finish_reason, c.stop_reason)
        if result is not None:
            st.result, st.reasoning_tokens = result, st.parser.reasoning_tokens(st.token_ids, result)
        return deltas

    def _usage(self, out: RequestOutput, st: _Completion):
        return pb2.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(st.token_ids),
                         cached_tokens=out.num_cached_tokens, reasoning_tokens=st.reasoning_tokens)

    def _complete(self, request, out: RequestOutput, c: CompletionOutput, st: _Completion, received_s: float,
                  now: float):
        finish_reason, parsed = c.finish_reason, {}
        result = st.result
        if result is not None:
            finish_reason = result.finish_reason(c.finish_reason)
            parsed = dict(reasoning_content=result.reasoning_content or "", content=result.content, tool_calls=[
                pb2.ToolCall(id=t["id"], name=t["function"]["name"], arguments_json=t["function"]["arguments"])
                for t in result.tool_calls])
        stop = c.stop_reason
        matched = {"stop_token_id": stop} if isinstance(stop, int) else {"stop_str": stop} if stop else {}
        m = out.metrics
        queue_s = (m.first_scheduled_time - m.arrival_time) if m and m.first_scheduled_time else 0.0
        timings = pb2.Timings(queue_s=queue_s, total_s=now - received_s,
                              ttft_s=(st.first_token_s - received_s) if st.first_token_s else 0.0)
        extra: dict[str, Any] = {}
        if not request.stream:
            extra.update(logprobs=st.logprobs, prompt_logprobs=st.prompt_logprobs)
        if c.cumulative_logprob is not None:
            extra["cumulative_logprob"] = c.cumulative_logprob
        if c.spec_decode is not None:  # cumulative: the terminal output holds the completion's totals
            extra["spec_decode"] = spec_decode_to_proto(c.spec_decode)
        return pb2.Complete(finish_reason=finish_reason, usage=self._usage(out, st), token_ids=st.token_ids,
                            text="".join(st.text), timings=timings, index=c.index, **matched, **parsed, **extra)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.engine.abort(rid)
        except Exception:  # noqa: BLE001 - the engine may be gone; nothing left to free then
            log.warning("abort of %s failed", rid, exc_info=True)

    # -- unary RPCs --------------------------------------------------------------------------------------
    @_guarded
    async def Abort(self, request, context):
        for rid in request.request_ids:
            if rid in self._active:
                log.info("abort of %s requested (%s)", rid, request.reason or "no reason given")
                await self.engine.abort(rid)
        return pb2.AbortResponse()

    @_guarded
    async def GetModelInfo(self, request, context):
        e, cfg, info = self.engine, self.engine.cfg, _engine_info(self.engine)
        kinds = info.get("kinds") or list((await self._stats()).get("blocks", {}))
        spec = (info.get("engine_args") or {}).get("speculative_config") or {}
        return pb2.ModelInfo(
            served_model_name=self.served_model_name, model_path=str(e.model_dir), architecture=cfg.arch,
            max_context_length=e.max_model_len, vocab_size=cfg.vocab_size, eos_token_ids=list(cfg.eos_token_ids),
            bos_token_id=cfg.bos_token_id, pad_token_id=cfg.pad_token_id,
            tokenizer_sha256=_tokenizer_sha256(e), kv_block_size=info.get("block_tokens", 0),
            capabilities=pb2.Capabilities(
                prefix_caching=bool(info.get("enable_prefix_caching")), chunked_prefill=True,
                speculative_method=spec.get("method", ""), max_draft_tokens=spec.get("num_speculative_tokens", 0),
                reasoning_parser=cfg.arch, tool_parser="dsml", chat=True, vision=SUPPORTS_VISION, cache_kinds=kinds),
            default_sampling_params_json=json.dumps(dataclasses.asdict(SamplingParams())))

    @_guarded
    async def GetServerInfo(self, request, context):
        from .. import __version__

        config = {"model_dir": str(self.engine.model_dir), "max_model_len": self.engine.max_model_len,
                  **_engine_info(self.engine)}
        return pb2.ServerInfo(version=__version__, uptime_s=time.monotonic() - self.started_s,
                              config_json=json.dumps(config, default=str), served_model_name=self.served_model_name)

    @_guarded
    async def GetLoads(self, request, context):
        s = await self._stats()
        spec = s.get("spec_decode")  # the engine's counts since start, present while it speculates
        return pb2.Loads(
            running=s.get("running", 0), waiting=s.get("waiting", 0),
            caches=[pb2.CacheUsage(kind=k, used_blocks=v["used"], cached_blocks=v["cached"], free_blocks=v["free"],
                                   total_blocks=v["total"]) for k, v in kv_blocks(s).items()],
            prefix_hit_rate=s.get("prefix_hit_rate", 0.0), num_preemptions=s.get("num_preemptions", 0),
            spec_decode=None if spec is None else spec_decode_to_proto(SpecDecodeStats.from_dict(spec)))

    async def _stats(self) -> dict:
        s = self.engine.stats()
        return (await s) if inspect.isawaitable(s) else s

    @_guarded
    async def Tokenize(self, request, context):
        kind = request.WhichOneof("input")
        if kind == "chat":
            ids = self._encode_chat(request.chat).ids
        elif kind == "text":
            ids = self.engine.tokenizer.encode(request.text, add_special_tokens=False).ids if request.text else []
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            if add and ids:  # what Generate does with text: BOS prepended, no template
                ids = [self.engine.cfg.bos_token_id, *ids]
        else:
            raise ValueError("TokenizeRequest needs an input: text or chat")
        return pb2.TokenizeResponse(token_ids=ids, max_model_len=self.engine.max_model_len)

    @_guarded
    async def Detokenize(self, request, context):
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in request.token_ids if t >= vocab]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb2.DetokenizeResponse(
            text=self.engine.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip))


# ---------------------------------------------------------------------------------------------- engine facts
def _engine_info(engine) -> dict:
    """The engine's resolved configuration (``engine.info``: :func:`v41.engine.info.engine_info`, offered by
    ``EngineClient`` and ``AsyncEngine``); {} for an engine without one."""
    info = getattr(engine, "info", None)
    return dict(info) if isinstance(info, dict) else {}


def _tokenizer_sha256(engine) -> str:
    """sha256 of the model's ``tokenizer.json`` bytes (else of the serialized tokenizer)."""
    path = Path(engine.model_dir) / "tokenizer.json"
    data = path.read_bytes() if path.is_file() else engine.tokenizer.to_str().encode()
    return hashlib.sha256(data).hexdigest()


async def serve_grpc(engine, host: str, port: int, served_model_name: str,
                     chat_revision: str | None = None) -> grpc.aio.Server:
    """Start the gRPC server on ``host:port`` (Engine + Health + reflection) and return it, started.
    ``chat_revision``: the chat format of chat inputs and parsed outputs (None: the model's; docs/model.md §7.1).

    Raises RuntimeError when the address cannot be bound.
    """
    server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    _add_engine_service(EngineServicer(engine, served_model_name, chat_revision), server)
    health_servicer = EngineHealth(engine, SERVICE_NAME)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"cannot bind the gRPC server to {address}")
    await server.start()
    await health_servicer.sync()
    task = asyncio.get_running_loop().create_task(watch_engine(server, health_servicer))
    _BACKGROUND.add(task)  # a strong reference until it ends with the server
    task.add_done_callback(_BACKGROUND.discard)
    log.info("gRPC server (%s) listening on %s", served_model_name, address)
    return server
