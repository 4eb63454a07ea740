"""v41: Rust-accelerated inference engine for DeepSeek-V4.1 / DeepSeek-V4."""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("v41")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
