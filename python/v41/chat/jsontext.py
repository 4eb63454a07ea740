"""JSON text of DSML ``string="false"`` values: strict decoding, complete and cut-off values.

Source: docs/model.md §7.6 (``string="false"`` values are JSON text), §7.10a (truncated calls); RFC 8259 §6
(numbers: ``NaN`` / ``Infinity`` are not JSON, and a number a double cannot hold is not portable).

Tool-call arguments must parse with any strict JSON parser, so a value is decoded strictly: the names
``NaN`` / ``Infinity`` / ``-Infinity`` and numbers that overflow a double (``1e999``) are errors, never
``float('inf')`` that ``json.dumps`` would write back as ``Infinity``. A value that does not decode keeps
its literal text, as a JSON string.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} does not fit a double")
    return value


def strict_loads(text: str) -> Any:
    """``json.loads`` that rejects ``NaN`` / ``Infinity`` and overflowing numbers. Errors: ``ValueError``."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def dumps(value: Any) -> str:
    """JSON text as the reference encoder writes it: ``ensure_ascii=False``, default separators."""
    return json.dumps(value, ensure_ascii=False)


def value_text(raw: str) -> str:
    """A complete ``string="false"`` value as JSON text: decoded strictly and re-serialised, else its
    literal text as a JSON string (``NaN``, ``1e999``, ``not json``)."""
    try:
        return dumps(strict_loads(raw))
    except ValueError:
        return dumps(raw)


def cut_value_text(raw: str) -> str | None:
    """A ``string="false"`` value cut off by the end of generation (docs/model.md §7.10a): its JSON text when
    ``raw`` already is a whole value that more text could not have continued (an object, array, string,
    ``true``, ``false`` or ``null``), else None (a number such as ``12`` may have been ``123``; text that does
    not decode is never turned into a string)."""
    try:
        value = strict_loads(raw)
    except ValueError:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None
    return dumps(value)
