"""The embedded tiny DeepSeek-V4.1 checkpoint: generated once per user, then reused.

``embedded_model_dir(seed=0)`` returns a directory in the user cache (``$V41_CACHE_DIR``, else
``$XDG_CACHE_HOME/v41``, else ``~/.cache/v41``) named after the generator version and the seed, so a new
generator never reuses an old checkpoint. The checkpoint is written into a temporary directory next to the
target, a marker file is written last, and the directory is renamed into place; concurrent callers race on
the rename and the losers delete their copy. Weights are random: the model writes gibberish.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .tiny import GENERATOR_VERSION, make_tiny

ARCH = "deepseek_v41"
MARKER = ".v41-complete"


def cache_dir() -> Path:
    """The v41 user cache directory (not created)."""
    env = os.environ.get("V41_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "v41"


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def embedded_model_dir(seed: int = 0) -> Path:
    """The embedded tiny V4.1 checkpoint for ``seed``, generating it on first use (safe across processes)."""
    root = cache_dir()
    final = root / f"tiny-{ARCH}-g{GENERATOR_VERSION}-s{int(seed)}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():  # incomplete leftover of some other writer: move it aside atomically, then drop it
        aside = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=root))
        try:
            os.rename(final, aside / "old")
        except OSError:
            pass  # someone else moved or replaced it
        shutil.rmtree(aside, ignore_errors=True)
        if _is_complete(final):
            return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        make_tiny(tmp, ARCH, seed=int(seed))
        (tmp / MARKER).write_text(f"generator={GENERATOR_VERSION} seed={int(seed)} arch={ARCH}\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # not a lost race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
