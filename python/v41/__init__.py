"""v41: Rust-accelerated inference engine for DeepSeek-V4.1 / DeepSeek-V4.

Public API (imported lazily, so ``import v41`` stays cheap): :class:`LLM` (offline generation),
:class:`AsyncEngine` (streaming), :class:`SamplingParams`, :class:`RequestOutput`, :class:`EngineArgs`,
:class:`SpeculativeConfig` (``speculative_config=``), :class:`SpecDecodeStats` (``CompletionOutput.spec_decode``).
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("v41")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "LLM": "v41.engine.llm",
    "AsyncEngine": "v41.engine.async_engine",
    "SamplingParams": "v41.engine.params",
    "RequestOutput": "v41.engine.params",
    "CompletionOutput": "v41.engine.params",
    "EngineArgs": "v41.engine.args",
    "SpeculativeConfig": "v41.engine.spec_config",
    "SpecDecodeStats": "v41.engine.spec_stats",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'v41' has no attribute {name!r}")
