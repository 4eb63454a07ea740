"""Marker search on streamed text: complete occurrences and held-back partial markers.

Source: docs/model.md §7.2 ("streaming parsers must match on text"), §7.10.

A streaming parser may act on text only when no later text can change the decision. These helpers give
the two facts needed: the earliest complete marker in a buffer, and how many trailing characters could
still be the start of a marker (held back until more text arrives or the stream ends). The markers used
never overlap one another (``formats.py``), so "earliest complete occurrence" is the same whether text
arrives at once or a character at a time. Cost: O(len(buffer) * markers) per call on the unconsumed tail.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_first(buf: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """``(position, marker)`` of the earliest complete marker in ``buf``, or None."""
    best: tuple[int, str] | None = None
    for m in markers:
        p = buf.find(m)
        if p >= 0 and (best is None or p < best[0]):
            best = (p, m)
    return best


def partial_tail(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of some marker (0 if none)."""
    held = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), held, -1):
            if buf.endswith(m[:k]):
                held = k
                break
    return held


def match_pattern(buf: str, patterns: Sequence[str], final: bool) -> str | None | bool:
    """Which of ``patterns`` ``buf`` starts with: the pattern; ``None`` when ``buf`` is still a proper
    prefix of one (wait for more text; never at the end of the stream); ``False`` when none can match."""
    for p in patterns:
        if buf.startswith(p):
            return p
    if not final and any(p.startswith(buf) for p in patterns):
        return None
    return False


def trailing_newlines(text: str, limit: int) -> int:
    """How many of the last ``limit`` characters of ``text`` are a run of ``\\n`` ending the text."""
    n = 0
    while n < limit and n < len(text) and text[len(text) - 1 - n] == "\n":
        n += 1
    return n
