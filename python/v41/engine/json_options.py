"""One parser for the engine's JSON-object options (``speculative_config``, ``engram_config``): a JSON object
string, a dict or an instance of the options class → the instance (None stays None)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any


def parse_options(cls, name: str, value: Any, required: dict[str, str] | None = None):
    """``value`` (a JSON object string, a dict, an instance of ``cls`` or None) as a ``cls`` (None stays None).
    Raises ValueError naming ``name`` for text that is not JSON, a non-object, an unknown key (listing the
    known ones), or a key of ``required`` (key → what it means) that is missing or null; ``cls`` itself checks
    the values."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict), got {type(value).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = [k for k in value if k not in known]
    if unknown:
        raise ValueError(f"{name}: unknown key {unknown[0]!r}; v41 knows {', '.join(known)}")
    for key, meaning in (required or {}).items():
        if value.get(key) is None:
            raise ValueError(f"{name}.{key} is required: {meaning}")
    return cls(**value)
