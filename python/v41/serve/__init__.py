"""Serving: the engine-core process and its client, the OpenAI HTTP app, the gRPC servicer, ``v41-serve``.

Front ends program against :class:`EngineProtocol` (``engine_client.py``); :class:`EngineClient` runs the
engine core in a process of its own (ZMQ + msgpack, ``messages.py`` / ``engine_proc.py``), and
:class:`v41.AsyncEngine` runs it on a thread of the caller's process. Names are imported lazily.
"""

from importlib import import_module

_EXPORTS = {
    "EngineProtocol": "v41.serve.engine_client",
    "EngineClient": "v41.serve.engine_client",
    "EngineStartupError": "v41.serve.engine_client",
    "QueueFullError": "v41.serve.errors",
    "EngineDeadError": "v41.engine.async_engine",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'v41.serve' has no attribute {name!r}")
