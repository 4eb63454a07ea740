"""Request checks shared by both front ends (``openai_app.py`` and ``grpc_server.py``): one function per
concern, so HTTP and gRPC refuse the same inputs with the same messages (issue 13).

Every check raises :class:`~v41.serve.errors.RequestError` (a ``ValueError``: HTTP 400 / gRPC
INVALID_ARGUMENT, ``serve/errors.py``) whose ``param`` names the offending field in the caller's terms:
``where`` is the field's name in that API (``"messages"`` over HTTP, ``"chat.messages_json"`` over gRPC).
Value ranges of sampling fields are checked by :meth:`v41.engine.params.SamplingParams.validate`, which both
front ends call with :func:`engine_max_n`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..engine.params import DEFAULT_MAX_N
from .errors import RequestError

# This build runs no vision encoder (checkpoint_names.py skips the checkpoint's ``vision.*`` weights), so image
# content parts are refused on every model rather than rendered as a bare image token (issue 13 item 11).
SUPPORTS_VISION = False
IMAGE_PART_TYPES = ("image", "image_url")


def engine_max_n(engine: Any) -> int:
    """The most completions (``n``) one request may ask for: ``engine.max_n`` (``EngineArgs.max_n``), else
    :data:`~v41.engine.params.DEFAULT_MAX_N` for an engine that does not say (test doubles)."""
    return int(getattr(engine, "max_n", DEFAULT_MAX_N))


# -- text ------------------------------------------------------------------------------------------------------
def check_text(value: Any, where: str) -> None:
    """RequestError naming the first string in ``value`` that is not valid Unicode text: one holding a lone
    surrogate such as ``"\\udfff"``, which JSON may escape but UTF-8 cannot encode and the tokenizer refuses
    (it raised ``TypeError: TextInputSequence must be str``, an HTTP 500; issue 13 item 2).

    ``value``: a str or JSON-like lists / dicts of them (dict keys are checked too; other leaves are
    skipped). ``where``: the field name of ``value``; "" for a whole request body, whose paths then start at
    its keys (``messages[0].content``). Iterative, so any nesting depth works; cost O(size of ``value``).
    The message never repeats the bad string (a JSON response could not encode it either).
    """
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            bad = _lone_surrogate(v)
            if bad is not None:
                raise RequestError(f"{path or 'the request'} must be valid UTF-8 text: a lone surrogate "
                                   f"(U+{ord(v[bad]):04X}) at character {bad}", path or None)
        elif isinstance(v, Mapping):
            items = list(v.items())
            for k, _ in items:
                if isinstance(k, str) and _lone_surrogate(k) is not None:
                    raise RequestError(f"{path or 'the request'} has a key that is not valid UTF-8 text (a lone "
                                       "surrogate)", path or None)
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in reversed(items))
        elif isinstance(v, (list, tuple)) and not _SCALARS.issuperset(map(type, v)):  # token ids: no visit
            stack.extend((f"{path}[{i}]", v[i]) for i in range(len(v) - 1, -1, -1)
                         if isinstance(v[i], (str, Mapping, list, tuple)))


_SCALARS = frozenset({int, float, bool, type(None)})


def _lone_surrogate(s: str) -> int | None:
    """Index of the first lone surrogate in ``s``, None when ``s`` encodes as UTF-8."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


# -- chat messages -----------------------------------------------------------------------------------------------
def validate_messages(messages: Any, where: str = "messages", *, vision: bool = SUPPORTS_VISION) -> None:
    """Check chat ``messages`` (OpenAI JSON: a list of message objects) before they are encoded.

    Refused, naming the field under ``where``: no list or an empty one (KF-16); a message that is no object;
    content that is not a string, a list of content parts or null; a content part that is no object, a text
    part without a string ``text``, an image part (``image`` / ``image_url``) when ``vision`` is False, a part
    of any other type (it was rendered as the literal text ``[Unsupported <type>]``; issue 13 item 11); a
    user message with no text (KF-16); ``tool_calls`` that are not a list of ``{"function": {"name": str,
    "arguments": str}}`` whose arguments hold a JSON object of valid text. Roles and the remaining fields are
    checked by the chat encoder (``v41.chat``), which raises ValueError.
    """
    if messages is None or (isinstance(messages, list) and not messages):
        raise RequestError(f"{where} is empty: give at least one message", where)
    if not isinstance(messages, list):
        raise RequestError(f"{where} must be a list of message objects", where)
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, Mapping):
            raise RequestError(f"{at} must be a message object", at)
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                _check_part(part, f"{at}.content[{j}]", vision)
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"{at}.content must be a string, a list of content parts or null", f"{at}.content")
        if m.get("role") == "user" and _is_empty_content(content):
            raise RequestError(f"{at}.content is empty: a user message needs text", f"{at}.content")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise RequestError(f"{at}.tool_calls must be a list", f"{at}.tool_calls")
        for j, call in enumerate(calls or []):
            _check_tool_call(call, f"{at}.tool_calls[{j}]")


def _check_part(part: Any, at: str, vision: bool) -> None:
    if not isinstance(part, Mapping):
        raise RequestError(f'{at} must be a content part object ({{"type": "text", "text": ...}})', at)
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{at}.text must be a string", f"{at}.text")
    elif kind in IMAGE_PART_TYPES:
        if not vision:
            raise RequestError(f"{at} is an image part ({kind!r}), but the served model takes no image input; "
                               "send text parts only", at)
    else:
        known = ["text", *IMAGE_PART_TYPES] if vision else ["text"]
        raise RequestError(f"{at} has the unsupported content part type {kind!r}; supported: {known}", at)


def _is_empty_content(content: Any) -> bool:
    if content is None or content == "":
        return True
    if isinstance(content, list):
        return all(p.get("type") == "text" and not p.get("text") for p in content)
    return False


def _check_tool_call(call: Any, at: str) -> None:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping):
        raise RequestError(f'{at} must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}', at)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{at}.function.name must be a non-empty string", f"{at}.function.name")
    arguments = fn.get("arguments")
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else None
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        raise RequestError(f"{at}.function.arguments must be a JSON object (as a string)", f"{at}.function.arguments")
    check_text(args, f"{at}.function.arguments")  # JSON escapes inside the string decode to surrogates too


# -- tools -------------------------------------------------------------------------------------------------------
def validate_tools(tools: Any, where: str = "tools") -> None:
    """Check tool definitions (OpenAI JSON: ``[{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}]``; None = no tools). Refused, naming the field under ``where``: no list; a tool
    that is no object or of another type than ``function``; a function without a non-empty string ``name``;
    a ``description`` that is no string, ``parameters`` that are no object (a JSON Schema), ``strict`` that is
    no bool; two functions with the same name (the tool-call parser could not tell them apart)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise RequestError(f"{where} must be a list of tools", where)
    names: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, Mapping):
            raise RequestError(f"{at} must be a tool object", at)
        if tool.get("type", "function") != "function":
            raise RequestError(f"{at}.type must be 'function'", f"{at}.type")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise RequestError(f'{at}.function must be an object ({{"name": ..., "parameters": ...}})',
                               f"{at}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{at}.function.name must be a non-empty string", f"{at}.function.name")
        for key, kind, what in (("description", str, "a string"), ("parameters", Mapping, "a JSON Schema object"),
                                ("strict", bool, "true or false")):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise RequestError(f"{at}.function.{key} must be {what}", f"{at}.function.{key}")
        if name in names:
            raise RequestError(f"{where} holds two functions with the same name ({name!r})", where)
        names.add(name)
