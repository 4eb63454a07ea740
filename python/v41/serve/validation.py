"""Request checks shared by both front ends (``openai_app.py`` and ``grpc_server.py``): one function per
concern, so HTTP and gRPC refuse the same inputs with the same messages (issue 13).

Every check raises :class:`~v41.serve.errors.RequestError` (a ``ValueError``: HTTP 400 / gRPC
INVALID_ARGUMENT, ``serve/errors.py``) whose ``param`` names the offending field in the caller's terms:
``where`` is the field's name in that API (``"messages"`` over HTTP, ``"chat.messages_json"`` over gRPC).
Value ranges of sampling fields are checked by :meth:`v41.engine.params.SamplingParams.validate`, which both
front ends call with :func:`engine_max_n`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..engine.params import DEFAULT_MAX_N
from .errors import RequestError


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
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{path}[{i}]", v[i]) for i in range(len(v) - 1, -1, -1))


def _lone_surrogate(s: str) -> int | None:
    """Index of the first lone surrogate in ``s``, None when ``s`` encodes as UTF-8."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None
