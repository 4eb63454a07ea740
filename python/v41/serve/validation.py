"""Request checks shared by both front ends (``openai_app.py`` and ``grpc_server.py``): one function per
concern, so HTTP and gRPC refuse the same inputs with the same messages (issue 13).

Every check raises :class:`~v41.serve.errors.RequestError` (a ``ValueError``: HTTP 400 / gRPC
INVALID_ARGUMENT, ``serve/errors.py``) whose ``param`` names the offending field in the caller's terms:
``where`` is the field's name in that API (``"messages"`` over HTTP, ``"chat.messages_json"`` over gRPC).
Value ranges of sampling fields are checked by :meth:`v41.engine.params.SamplingParams.validate`, which both
front ends call with :func:`engine_max_n`.
"""

from __future__ import annotations

from typing import Any

from ..engine.params import DEFAULT_MAX_N


def engine_max_n(engine: Any) -> int:
    """The most completions (``n``) one request may ask for: ``engine.max_n`` (``EngineArgs.max_n``), else
    :data:`~v41.engine.params.DEFAULT_MAX_N` for an engine that does not say (test doubles)."""
    return int(getattr(engine, "max_n", DEFAULT_MAX_N))
