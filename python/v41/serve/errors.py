"""The one mapping of front-end and engine errors to HTTP status / OpenAI error JSON / gRPC status codes.

Both front ends (HTTP: ``openai_server.py``; ``grpc_server.py``) call :func:`error_status` and never map
errors themselves (docs/style.md §8). gRPC codes are given as ``grpc.StatusCode`` member names (``"INVALID_ARGUMENT"``)
so this module does not import grpc; the gRPC server does ``grpc.StatusCode[status.grpc_code]``.

=============================== ====== ================== ========================================
exception                       HTTP   gRPC               meaning
=============================== ====== ================== ========================================
:class:`ModelNotFoundError`     400    INVALID_ARGUMENT   unknown model name (issue 6 item 5)
``ValueError`` (incl. pydantic) 400    INVALID_ARGUMENT   bad input: empty or too long prompt, bad
                                                          sampling value, malformed tools, ...
:class:`QueueFullError`         429    RESOURCE_EXHAUSTED the engine refuses more requests now
:class:`ClientDisconnected`     499    CANCELLED          the caller went away; its request aborted
``EngineDeadError``             503    UNAVAILABLE        the engine core died or was shut down
``TimeoutError``                504    DEADLINE_EXCEEDED  a deadline passed
``NotImplementedError``         501    UNIMPLEMENTED      a feature this build lacks
anything else                   500    INTERNAL           our bug; logged with its traceback
=============================== ====== ================== ========================================
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


class RequestError(ValueError):
    """Bad input found by a front end; ``param`` names the offending request field (OpenAI ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelNotFoundError(RequestError):
    """The request names a model this server does not serve."""

    def __init__(self, model: str, served: str):
        super().__init__(f"the model {model!r} does not exist; this server serves {served!r}", param="model")


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full; the request was not accepted (retry later). Raised by the engine
    client before any output."""


class ClientDisconnected(Exception):
    """The client closed the connection before its response was complete; the request was aborted."""


@dataclass(frozen=True)
class ErrorStatus:
    """How one error is reported: HTTP status, gRPC ``StatusCode`` name, OpenAI error ``type``/``code``."""

    http_status: int
    grpc_code: str
    type: str
    code: str | None = None


BAD_REQUEST = ErrorStatus(400, "INVALID_ARGUMENT", "invalid_request_error")
MODEL_NOT_FOUND = ErrorStatus(400, "INVALID_ARGUMENT", "invalid_request_error", "model_not_found")
QUEUE_FULL = ErrorStatus(429, "RESOURCE_EXHAUSTED", "rate_limit_error", "queue_full")
CANCELLED = ErrorStatus(499, "CANCELLED", "cancelled")
ENGINE_DEAD = ErrorStatus(503, "UNAVAILABLE", "service_unavailable", "engine_dead")
DEADLINE = ErrorStatus(504, "DEADLINE_EXCEEDED", "timeout")
UNIMPLEMENTED = ErrorStatus(501, "UNIMPLEMENTED", "not_implemented")
INTERNAL = ErrorStatus(500, "INTERNAL", "internal_error")


def _is_engine_dead(exc: BaseException) -> bool:
    # Matched by name as well as by class: the engine client may define (and later re-export) its own
    # EngineDeadError, and this module must not import the engine process machinery.
    from ..engine.async_engine import EngineDeadError

    return isinstance(exc, EngineDeadError) or any(c.__name__ == "EngineDeadError" for c in type(exc).__mro__)


def error_status(exc: BaseException) -> ErrorStatus:
    """The status of ``exc`` (see the module table); INTERNAL for anything unexpected."""
    if isinstance(exc, ModelNotFoundError):
        return MODEL_NOT_FOUND
    if isinstance(exc, QueueFullError):
        return QUEUE_FULL
    if isinstance(exc, (ClientDisconnected, asyncio.CancelledError)):
        return CANCELLED
    if _is_engine_dead(exc):
        return ENGINE_DEAD
    if isinstance(exc, ValueError):
        return BAD_REQUEST
    if isinstance(exc, TimeoutError):
        return DEADLINE
    if isinstance(exc, NotImplementedError):
        return UNIMPLEMENTED
    return INTERNAL


def error_message(exc: BaseException) -> str:
    """A one-line message for the client (the exception's text, else its class name)."""
    msg = str(exc).strip()
    return msg or type(exc).__name__


def openai_error_body(exc: BaseException, status: ErrorStatus | None = None) -> dict:
    """The OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}`` of ``exc``."""
    status = status or error_status(exc)
    message = f"internal server error ({type(exc).__name__})" if status is INTERNAL else error_message(exc)
    return {"error": {"message": message, "type": status.type, "param": getattr(exc, "param", None),
                      "code": status.code if status.code is not None else status.http_status}}
