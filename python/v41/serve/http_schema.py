"""Pydantic models of the OpenAI-compatible HTTP API (requests and responses).

Request models accept and ignore fields they do not know (OpenAI clients send many) and check types and
shapes only, strictly (pydantic strict mode, issue 13 item 9): ``"max_tokens": "5"``, ``"n": 3.0``,
``"stream": "yes"`` or ``"temperature": true`` are 400s naming the field, never coerced (an integer is still
a valid float). Value ranges (temperature >= 0, top_p in (0, 1], 1 <= n <= max_n, max_tokens >= 1, ...) are
checked once, by :meth:`v41.engine.params.SamplingParams.validate`, so HTTP and gRPC report the same
messages. Response models mirror OpenAI's JSON plus DeepSeek's ``reasoning_content`` and vLLM's
``prompt_tokens_details``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# ------------------------------------------------------------------------------------------------ requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Sampling, stopping and scheduling fields shared by chat and completions (vLLM's extra fields included:
    ``priority``, lower runs first; ``cache_salt``, the prefix-cache namespace)."""

    model: str | None = None  # None: the served model
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> additive bias
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    priority: int = 0  # strict, as the Python API: true, "1" and 1.0 are refused, not coerced
    cache_salt: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(_Request):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI)


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessageIn(BaseModel):
    """One input message; unknown fields are kept and passed to the chat encoder."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn]
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: bool | dict[str, Any] | None = None  # DeepSeek's {"type": "enabled" | "disabled"}
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessageIn] | None = None
    tools: list[ToolDefinition] | None = None
    reasoning_effort: str | int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False


# ----------------------------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class SpecDecodeUsage(BaseModel):
    """Speculative-decoding counts of one HTTP request, every completion of every prompt added up
    (:class:`v41.engine.spec_stats.SpecDecodeStats`; docs/speculative-decoding.md "Metrics"). Per position: [K],
    0-based. ``acceptance_rate`` (accepted / draft tokens, pooled) and ``mean_acceptance_length``
    (1 + accepted / drafts) are null before any draft."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    verified_per_position: list[int]
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None


class Usage(BaseModel):
    """OpenAI's usage, plus vLLM's token details and ``spec_decode`` (None, left out of stream chunks, when the
    engine does not speculate)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    spec_decode: SpecDecodeUsage | None = None


class ToolCallFunctionOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunctionOut


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI streaming tool-call deltas


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "v41"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------------------- logprobs from the engine

_MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)


def _lp(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


def _token_text(tok: int, entry: Any, decode: Any) -> str:
    text = getattr(entry, "decoded_token", None)
    return text if text is not None else decode(tok)


def _top(entry: dict, n: int) -> list[tuple[int, Any]]:
    """The ``n`` best alternatives of one position, best first (by rank, else by logprob)."""
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                  -kv[1].logprob))
    return ranked[:n]


def chat_logprobs(token_ids: list[int], entries: list[dict], top_n: int, decode: Any) -> list[TokenLogprob]:
    """OpenAI chat ``logprobs.content`` of generated tokens from the engine's per-token ``{id: Logprob}``
    maps; ``decode(id) -> str`` is used when an entry lacks its text."""
    out = []
    for tok, entry in zip(token_ids, entries):
        if not entry or tok not in entry:
            continue
        text = _token_text(tok, entry[tok], decode)
        tops = [TopLogprob(token=(t := _token_text(i, e, decode)), logprob=_lp(e.logprob),
                           bytes=list(t.encode("utf-8"))) for i, e in _top(entry, top_n)]
        out.append(TokenLogprob(token=text, logprob=_lp(entry[tok].logprob), bytes=list(text.encode("utf-8")),
                                top_logprobs=tops))
    return out


def completion_logprobs(token_ids: list[int], entries: list[dict | None], top_n: int, decode: Any,
                        text_offset_0: int = 0) -> CompletionLogprobs:
    """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset); an entry of None
    (the first prompt position) gives nulls."""
    lp = CompletionLogprobs()
    offset = text_offset_0
    for tok, entry in zip(token_ids, entries):
        e = entry.get(tok) if entry else None
        text = _token_text(tok, e, decode) if e is not None else decode(tok)
        lp.tokens.append(text)
        lp.text_offset.append(offset)
        offset += len(text)
        lp.token_logprobs.append(_lp(e.logprob) if e is not None else None)
        lp.top_logprobs.append({_token_text(i, x, decode): _lp(x.logprob) for i, x in _top(entry, top_n)}
                               if entry else None)
    return lp
