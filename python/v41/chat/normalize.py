"""Input normalisation: OpenAI-style messages -> typed chat messages ready to render.

Source: docs/model.md §7.3 (roles, content lists, tool messages merged into user turns, result order,
tool definitions, tool-call arguments), §7.9 (tasks, image placeholder).

Steps, in order: validate each message; turn content lists into blocks (images become placeholder parts,
collected later in prompt order); turn every ``tool`` message into a tool-result block of a merged user
turn; re-order tool results to the call order of the most recent assistant message with tool calls.
Nothing here depends on thinking mode or the drop rule (see ``render.py``).

Deliberate differences from the reference encoder, all on inputs it mishandles: ``None`` content renders as
"" everywhere; V4 accepts argument objects as well as JSON strings (the reference wraps an object as one
``arguments`` parameter, a history-corruption bug); a literal ``<｜deepseek_image｜>`` in text is kept as
plain text (tokenized as characters, so it can never become an image slot) instead of being rejected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .formats import TASK_MARKERS, FormatProfile


@dataclass(frozen=True, slots=True)
class ImagePart:
    """An image content part (``type`` ``image`` or ``image_url``); renders as the image placeholder."""

    block: Any


Part = str | ImagePart  # a piece of message text


@dataclass(slots=True)
class TextBlock:
    parts: list[Part]


@dataclass(slots=True)
class ToolResultBlock:
    tool_call_id: str
    parts: list[Part]


Block = TextBlock | ToolResultBlock


@dataclass(slots=True)
class ToolCall:
    """One historical tool call; ``arguments`` in key order (§7.3 "Tool-call arguments")."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(slots=True)
class ChatMessage:
    """A normalised message. ``blocks`` render joined by ``\\n\\n`` (one text block for string content)."""

    role: str
    blocks: list[Block] = field(default_factory=list)
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI `function` objects
    response_format: Any = None
    task: str | None = None
    wo_eos: bool = False


def attach_request_fields(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None, response_format: Any
) -> list[Mapping[str, Any]]:
    """Attach request-level ``tools``/``response_format`` to message 0 if it is a system message, else to
    a new empty system message inserted at index 0 (§7.3 "Tool definitions")."""
    out = list(messages)
    extra = {k: v for k, v in (("tools", tools), ("response_format", response_format)) if v}
    if not extra:
        return out
    if out and isinstance(out[0], Mapping) and out[0].get("role") == "system":
        clash = [k for k in extra if out[0].get(k)]
        if clash:
            raise ValueError(f"{clash[0]} given both as an argument and on the system message")
        out[0] = {**out[0], **extra}
    else:
        out.insert(0, {"role": "system", "content": "", **extra})
    return out


def normalize(
    messages: Sequence[Mapping[str, Any]], prof: FormatProfile, call_order: Mapping[str, int] | None = None
) -> list[ChatMessage]:
    """Validate, merge tool results into user turns and order them (§7.3). ``call_order``: the call order
    (:func:`latest_call_order`) of the context these messages continue, for results that answer an assistant
    message of the context (§7.9 incremental encoding). Errors: ``ValueError``."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of message objects")
    merged: list[ChatMessage] = []
    for i, raw in enumerate(messages):
        if not isinstance(raw, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(raw).__name__}")
        role = raw.get("role")
        where = f"messages[{i}]"
        if role not in prof.roles:
            hint = " (the V4.1 release format has no developer role; use system or user)" if role == "developer" else ""
            raise ValueError(f"{where}: unknown role {role!r}{hint}; the {prof.name} format accepts {list(prof.roles)}")
        if role == "tool":
            block = ToolResultBlock(_str_field(raw, "tool_call_id", where), _content_parts(raw, prof, where))
            if merged and merged[-1].role == "user":
                merged[-1].blocks.append(block)
            else:
                merged.append(ChatMessage("user", [block]))
            continue
        msg = _message(raw, role, prof, where)
        if role == "user" and merged and merged[-1].role == "user" and merged[-1].task is None:
            merged[-1].blocks.extend(msg.blocks)
        else:
            merged.append(msg)
    _order_tool_results(merged, dict(call_order or {}))
    return merged


def _message(raw: Mapping[str, Any], role: str, prof: FormatProfile, where: str) -> ChatMessage:
    msg = ChatMessage(role)
    if role == "user":
        msg.blocks = _user_blocks(raw, prof, where)
    else:
        msg.blocks = [TextBlock(_content_parts(raw, prof, where))]
    if role == "developer" and not any(p for b in msg.blocks for p in b.parts):
        raise ValueError(f"{where}: a developer message needs non-empty content")
    task = raw.get("task")
    if task is not None and task not in TASK_MARKERS:
        raise ValueError(f"{where}: unknown task {task!r}; expected one of {list(TASK_MARKERS)}")
    msg.task = task
    wo_eos = raw.get("wo_eos", False)
    if not isinstance(wo_eos, bool):
        raise ValueError(f"{where}: wo_eos must be a bool")
    msg.wo_eos = wo_eos
    if role == "user" and not prof.content_lists:
        return msg  # V4 keeps only content, task, wo_eos (and mask) of a user message
    msg.tools = _tool_definitions(raw.get("tools"), where)
    msg.response_format = raw.get("response_format")
    if role == "assistant":
        reasoning = raw.get("reasoning_content")
        if reasoning is None:
            reasoning = raw.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{where}: reasoning_content must be a string")
        msg.reasoning = reasoning or ""
        msg.tool_calls = _tool_calls(raw.get("tool_calls"), where)
    return msg


def _str_field(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key} must be a string")
    return value


def _parts_of_list(items: Sequence[Any], prof: FormatProfile, where: str) -> list[list[Part]]:
    """A content list -> one part list per item (images kept as :class:`ImagePart`)."""
    out: list[list[Part]] = []
    for j, item in enumerate(items):
        if isinstance(item, str):
            out.append([item])
            continue
        if not isinstance(item, Mapping):
            raise ValueError(f"{where}.content[{j}] must be an object")
        kind = item.get("type")
        if kind == "text":
            text = item.get("text")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{where}.content[{j}].text must be a string")
            out.append([text or ""])
        elif kind in ("image", "image_url"):
            if not prof.content_lists:
                raise ValueError(f"{where}: image content needs the V4.1 format (revision {prof.name} is text-only)")
            out.append([ImagePart(item)])
        else:
            out.append([f"[Unsupported {kind}]"])
    return out


def _join(blocks: list[list[Part]]) -> list[Part]:
    parts: list[Part] = []
    for j, b in enumerate(blocks):
        if j:
            parts.append("\n\n")
        parts.extend(b)
    return parts


def _content_parts(raw: Mapping[str, Any], prof: FormatProfile, where: str) -> list[Part]:
    content = raw.get("content")
    if content is None:
        return [""]
    if isinstance(content, str):
        return [content]
    if isinstance(content, Sequence) and not isinstance(content, (bytes, Mapping)):
        return _join(_parts_of_list(content, prof, where))
    raise ValueError(f"{where}: content must be a string, a list of content parts or null")


def _user_blocks(raw: Mapping[str, Any], prof: FormatProfile, where: str) -> list[Block]:
    content = raw.get("content")
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes, Mapping)):
        return [TextBlock(p) for p in _parts_of_list(content, prof, where)]
    return [TextBlock(_content_parts(raw, prof, where))]


def _list_field(value: Any, where: str, name: str) -> Sequence[Any]:
    """A message's list field ``name``: ``[]`` when missing or empty. Errors: ``ValueError`` if not a list."""
    if not value:
        return []
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ValueError(f"{where}: {name} must be a list")
    return value


def _tool_definitions(tools: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for j, tool in enumerate(_list_field(tools, where, "tools")):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping):
            raise ValueError(f'{where}.tools[{j}] must be {{"type": "function", "function": {{...}}}}')
        out.append(dict(fn))
    return out


def _tool_calls(calls: Any, where: str) -> list[ToolCall]:
    out = []
    for j, call in enumerate(_list_field(calls, where, "tool_calls")):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f'{where}.tool_calls[{j}] must be {{"function": {{"name": str, "arguments": ...}}}}')
        call_id = call.get("id") or fn.get("id") or ""
        out.append(ToolCall(str(call_id), fn["name"], tool_arguments(fn.get("arguments"))))
    return out


def tool_arguments(arguments: Any) -> dict[str, Any]:
    """Arguments as an object (§7.3): an object as is; a string JSON-decoded at most twice; anything that
    does not end up an object becomes the single parameter ``arguments`` holding the raw value. ``None`` and
    an empty or blank string (no arguments given; clients send ``""`` for zero-argument calls) are ``{}``
    (docs/model.md §7.10a)."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    value = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    if isinstance(value, Mapping):
        return dict(value)
    return {"arguments": arguments}


def latest_call_order(messages: Sequence[ChatMessage]) -> dict[str, int]:
    """Call id -> position in the last assistant message with tool calls (``{}`` if there is none)."""
    for msg in reversed(messages):
        if msg.role == "assistant" and msg.tool_calls:
            return {c.id: k for k, c in enumerate(msg.tool_calls) if c.id}
    return {}


def _order_tool_results(messages: list[ChatMessage], order: dict[str, int]) -> None:
    """Re-order each merged user turn's tool results to the latest assistant call order, starting from
    ``order`` (stable sort; unknown ids sort as position 0; text blocks keep their places)."""
    for msg in messages:
        if msg.role == "assistant" and msg.tool_calls:
            order = latest_call_order([msg])
        elif msg.role == "user" and order:
            slots = [k for k, b in enumerate(msg.blocks) if isinstance(b, ToolResultBlock)]
            if len(slots) < 2:
                continue
            results = sorted((msg.blocks[k] for k in slots), key=lambda b: order.get(b.tool_call_id, 0))  # type: ignore[union-attr]
            for k, block in zip(slots, results):
                msg.blocks[k] = block
