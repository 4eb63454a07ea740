"""``POST /v1/chat/completions``: chat prompts encoded with ``v41.chat``, outputs parsed into reasoning,
content and tool calls, answered as one JSON body or an SSE stream.

* Tool choice: ``none`` renders and parses no tools; ``auto`` and ``required`` render and parse all; a named
  function renders only that tool. There is no constrained decoding, so ``required``/named are best effort.
  As in vLLM, ``auto`` -- also the default when a request brings tools -- needs the server started with
  ``--enable-auto-tool-choice`` (README.md "Serving"); without it such a request is a 400 naming tool_choice.
* Chat output is parsed from token ids (``v41.chat.OutputParser``); the token that stopped generation (EOS
  or a stop token id) is not fed to the parser. Stop *strings* are matched by the engine on the raw text
  and end generation, but the parser sees the tokens that held them (known limitation).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..chat import OutputParser, encode_chat
from ..chat.formats import DEFAULT_REVISION_BY_MODEL_TYPE
from ..engine.params import CompletionOutput, SamplingParams
from . import http_schema as hs
from .errors import RequestError
from .generation import EventStream, Generation, prime_stream
from .openai_server import OpenAIServer
from .validation import validate_messages, validate_tools

_EFFORT_ALIASES = {"minimal": "low", "medium": "high"}  # OpenAI names the V4.1 encoder does not know


class ChatCompletions:
    """The chat endpoint of ``server``; ``revision``: the chat format revision (None: the model's default);
    ``auto_tool_choice``: whether ``tool_choice: auto`` is allowed (module docstring)."""

    def __init__(self, server: OpenAIServer, revision: str | None = None, auto_tool_choice: bool = False):
        self.server = server
        self._revision = revision
        self.auto_tool_choice = auto_tool_choice

    @property
    def revision(self) -> str:
        """The chat format revision (docs/model.md §7.1): given, else the model's default."""
        if self._revision is None:
            self._revision = DEFAULT_REVISION_BY_MODEL_TYPE[self.server.cfg.arch]
        return self._revision

    def encode_chat(self, messages: list[hs.ChatMessageIn], tools: list[hs.ToolDefinition] | None,
                    tool_choice: Any, effort: str | int | None, template_kwargs: dict | None,
                    thinking_field: bool | dict | None,
                    response_format: dict | None = None) -> tuple[list[int], bool, list[dict] | None]:
        """Prompt ids, effective thinking flag and the tools to render/parse (None: no tools). Raises
        RequestError (:func:`~v41.serve.validation.validate_messages` and ``validate_tools``, the checks gRPC
        runs too: KF-16 no messages or an empty user message, malformed tool calls or tools, image or unknown
        content parts; and a bad tool_choice) and the encoder's ValueError. ``response_format`` is rendered
        into the prompt (no constrained decoding)."""
        msgs = [m.model_dump(exclude_none=True) for m in messages]
        validate_messages(msgs, "messages")
        tool_list = [t.model_dump(exclude_none=True) for t in tools or []]
        validate_tools(tool_list, "tools")
        tool_dicts = _select_tools(tool_list, tool_choice)
        thinking, effort = _resolve_thinking(template_kwargs, thinking_field, effort)
        if response_format is not None and response_format.get("type") == "text":
            response_format = None
        enc = encode_chat(self.server.tokenizer, msgs, tools=tool_dicts, thinking=thinking,
                          reasoning_effort=effort, revision=self.revision, response_format=response_format)
        return list(enc.token_ids), enc.thinking, tool_dicts

    async def create(self, req: hs.ChatCompletionRequest, request: Request) -> Response:
        """Answer one chat completion request (JSON, or SSE when ``stream``)."""
        server = self.server
        arrival_s = time.monotonic()
        server.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        top_n = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sp = server.sampling_params(req, max_tokens, top_n if req.logprobs else None)
        _check_auto_tool_choice(req, self.auto_tool_choice)
        ids, thinking, tools = self.encode_chat(req.messages, req.tools, req.tool_choice, req.reasoning_effort,
                                                req.chat_template_kwargs, req.thinking, req.response_format)
        server.check_prompt(ids, sp, "messages")

        def new_choice(index: int) -> ChatChoice:
            return ChatChoice(index, OutputParser(server.tokenizer, thinking=thinking, tools=tools, prompt_ids=ids,
                                                  revision=self.revision))

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = server.start(rid, [(None, ids)], sp, arrival_s, req)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            await prime_stream(gen, request)
            return EventStream(self._events(gen, rid, sp, new_choice, top_n, include_usage), gen,
                               server.error_event)
        choices: dict[int, ChatChoice] = {}
        await gen.drain(request, lambda _p, _out, c: choices.get(c.index) or choices.setdefault(
            c.index, new_choice(c.index)))
        decode = server.decode_token
        out = [hs.ChatChoice(index=i, message=st.message(), finish_reason=st.openai_finish_reason,
                             stop_reason=st.stop_reason,
                             logprobs=hs.ChatLogprobs(content=hs.chat_logprobs(st.ids, st.lps, top_n, decode))
                             if sp.logprobs is not None else None)
               for i, st in sorted(choices.items())]
        resp = hs.ChatCompletionResponse(id=rid, model=server.served_model_name, choices=out,
                                         usage=gen.usage(choices.values()))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _events(self, gen: Generation, rid: str, sp: SamplingParams, new_choice, top_n: int,
                      include_usage: bool) -> AsyncIterator[str]:
        server = self.server
        created, model = int(time.time()), server.served_model_name
        choices: dict[int, ChatChoice] = {}

        def event(choice: hs.ChatChunkChoice | None, usage: hs.Usage | None = None) -> str:
            chunk = hs.ChatCompletionChunk(id=rid, created=created, model=model,
                                           choices=[] if choice is None else [choice], usage=usage)
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

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
                                                                  server.decode_token))
                if reasoning or content or tool_deltas or lp is not None:
                    yield event(hs.ChatChunkChoice(index=c.index, logprobs=lp, delta=hs.ChatDelta(
                        reasoning_content=reasoning or None, content=content or None,
                        tool_calls=tool_deltas or None)))
                if st.done:
                    yield event(hs.ChatChunkChoice(index=c.index, delta=hs.ChatDelta(),
                                                   finish_reason=st.openai_finish_reason,
                                                   stop_reason=st.stop_reason))
        if include_usage:
            yield event(None, gen.usage(choices.values()))


class ChatChoice:
    """One chat completion being parsed (``v41.chat.OutputParser``): its ids, logprobs and final result."""

    def __init__(self, index: int, parser: OutputParser):
        self.index = index
        self.parser = parser
        self.ids: list[int] = []
        self.lps: list = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.result: Any = None  # v41.chat.ParserResult once finished

    @property
    def done(self) -> bool:
        """The completion has finished (its last delta was fed)."""
        return self.finish_reason is not None

    def feed(self, c: CompletionOutput) -> tuple[str, str, list[dict]]:
        """Account one delta; returns the new (reasoning, content, OpenAI tool-call deltas) to stream."""
        ids = list(c.token_ids)
        self.ids += ids
        if c.logprobs:
            self.lps += c.logprobs
        deltas, result = self.parser.feed_engine_output(ids, c.finish_reason, c.stop_reason)
        if result is not None:
            self.finish_reason, self.stop_reason, self.result = c.finish_reason, c.stop_reason, result
        return ("".join(d.reasoning_delta for d in deltas), "".join(d.content_delta for d in deltas),
                [t.to_openai() for d in deltas for t in d.tool_call_deltas])

    @property
    def tool_calls(self) -> list[dict]:
        """The parsed tool calls, OpenAI-shaped ([] until finished)."""
        return self.result.tool_calls if self.result is not None else []

    @property
    def openai_finish_reason(self) -> str | None:
        """The engine's finish reason, "tool_calls" when the parser found calls."""
        return self.result.finish_reason(self.finish_reason) if self.result is not None else self.finish_reason

    @property
    def reasoning_tokens(self) -> int:
        """Generated tokens before ``</think>`` (all of them if reasoning never closed); 0 without reasoning."""
        return 0 if self.result is None else self.parser.reasoning_tokens(self.ids, self.result)

    def message(self) -> hs.ChatMessageOut:
        """The finished assistant message (content, reasoning_content, tool_calls) of a non-streamed reply."""
        calls = [hs.ToolCallOut(id=c["id"], function=hs.ToolCallFunctionOut(
            name=c["function"]["name"], arguments=c["function"]["arguments"])) for c in self.tool_calls]
        content = self.result.content
        return hs.ChatMessageOut(content=None if calls and not content else content,
                                 reasoning_content=self.result.reasoning_content, tool_calls=calls)


def _check_auto_tool_choice(req: hs.ChatCompletionRequest, allowed: bool) -> None:
    """RequestError when ``req`` brings tools with ``tool_choice`` auto (given, or left out) and the server
    does not allow it (module docstring)."""
    if req.tools and req.tool_choice in (None, "auto") and not allowed:
        how = "'auto' (the default when tools are given)" if req.tool_choice is None else "'auto'"
        raise RequestError(f"tool_choice {how} needs the server started with --enable-auto-tool-choice; otherwise "
                           f"send tool_choice 'none', 'required' or a named tool", "tool_choice")


def _select_tools(tools: list[dict], tool_choice: Any) -> list[dict] | None:
    """The tools to render and parse for ``tool_choice`` (module docstring) from validated ``tools``;
    RequestError when it is inconsistent with ``tools``."""
    names = [t["function"]["name"] for t in tools]
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
