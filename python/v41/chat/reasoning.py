"""Reasoning / content split of generated text, and the parser's start state.

Source: docs/model.md §7.10 (start state, ``</think>``, implicit end at a tool block), §7.9
(continuation, tasks), docs/known-failures.md KF-03 and KF-04.

Rules (all matched on text; a partial marker at the end of the text is held back):

* start state: from how the prompt ends -- the last of ``<think>`` (reasoning), ``</think>`` or a task marker
  (content) after the last turn boundary; without prompt ids or such a marker, the effective thinking flag;
* reasoning: ``</think>`` ends it and the text continues as content; with tools, ``<｜DSML｜`` ends it
  implicitly and opens a tool block; a stray ``<think>`` is dropped;
* content: with tools, ``<｜DSML｜`` opens a tool block; stray ``<think>``/``</think>`` are dropped;
* with tools, a DSML closing tag outside a block (``</｜DSML｜ calls>``, ``</｜DSML｜tool_calls>``, any closing tag
  name of ``dsml.CLOSE_TAGS``, or a bare ``</｜DSML｜``) is dropped in reasoning and content alike: DSML markup
  never reaches the user (docs/model.md §7.10a);
* before a tool block up to two ``\\n`` (the format's separator) are removed from the preceding text;
* ``<｜end▁of▁sentence｜>`` ends the output; it and anything after it appear in no field;
* KF-03 policy: reasoning is held back until it closes or exceeds ``holdback_chars`` characters; output that
  ends inside reasoning held back this way (no ``</think>``, no tool block) is delivered as **content** -- a
  model that answers without closing its reasoning. Longer unterminated reasoning has already streamed as
  reasoning and stays reasoning (a chain of thought cut short). ``holdback_chars=None`` holds all
  reasoning until it closes, so every unterminated output becomes content.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from .deltas import Emitter
from .dsml import CLOSE as DSML_CLOSE
from .dsml import CLOSE_TAGS
from .dsml import OPEN as DSML_OPEN
from .formats import BOS, EOS, SYSTEM, TASK_MARKERS, THINK_CLOSE, THINK_OPEN, USER
from .textscan import find_first, match_pattern, partial_tail, trailing_newlines

DEFAULT_HOLDBACK_CHARS = 256
_SEPARATOR_NEWLINES = 2


class Phase(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOLS = "tools"
    END = "end"


def start_phase(prompt_ids: Sequence[int] | None, marker_ids: dict[str, int], thinking: bool) -> Phase:
    """Where generation starts (§7.10): scan the prompt back to the last turn boundary."""
    if prompt_ids:
        get = marker_ids.get
        boundary = {get(m) for m in (USER, SYSTEM, EOS, BOS)} - {None}
        content = {get(THINK_CLOSE)} | {get(m) for m in TASK_MARKERS.values()}
        for t in reversed(prompt_ids):
            if t == get(THINK_OPEN):
                return Phase.REASONING
            if t in content:
                return Phase.CONTENT
            if t in boundary:
                break
    return Phase.REASONING if thinking else Phase.CONTENT


class ReasoningSplitter:
    """Consumes text in the reasoning and content phases (see module doc). ``tools``: tool blocks are
    recognised; ``holdback_chars``: the KF-03 hold-back length (None = until the reasoning closes)."""

    def __init__(self, tools: bool, holdback_chars: int | None = DEFAULT_HOLDBACK_CHARS) -> None:
        self._tools = tools
        self._holdback = holdback_chars
        self._held: list[str] = []
        self._held_chars = 0
        self._released = False

    def step(self, phase: Phase, buf: str, final: bool, out: Emitter) -> tuple[int, Phase]:
        """Consume a prefix of ``buf``; return ``(chars consumed, next phase)``."""
        reasoning = phase is Phase.REASONING
        markers = [EOS, THINK_OPEN, THINK_CLOSE] + ([DSML_OPEN, DSML_CLOSE] if self._tools else [])
        hit = find_first(buf, markers)
        if hit is None:
            end = len(buf)
            if not final:
                end -= partial_tail(buf, markers)
                if self._tools:
                    end -= trailing_newlines(buf[:end], _SEPARATOR_NEWLINES)
            self._emit(reasoning, buf[:end], out)
            return end, phase
        pos, marker = hit
        text = buf[:pos]
        if marker == DSML_OPEN:
            text = text[: len(text) - trailing_newlines(text, _SEPARATOR_NEWLINES)]
        self._emit(reasoning, text, out)
        consumed = pos + len(marker)
        if marker == DSML_CLOSE:  # a stray closing tag: dropped with its tag name once that is known
            tag = match_pattern(buf[consumed:], CLOSE_TAGS, final)
            if tag is None:
                return pos, phase
            return consumed + (len(tag) if tag else 0), phase
        if marker == THINK_OPEN or (marker == THINK_CLOSE and not reasoning):
            return consumed, phase  # stray marker: dropped
        if marker == EOS:
            if reasoning:
                self.end_unterminated(out)
            return consumed, Phase.END
        if reasoning:
            self._release(out)
        return consumed, Phase.CONTENT if marker == THINK_CLOSE else Phase.TOOLS

    def end_unterminated(self, out: Emitter) -> None:
        """The output ended inside reasoning: held-back reasoning becomes content (KF-03)."""
        out.content.extend(self._held)
        self._held, self._held_chars = [], 0

    def _emit(self, reasoning: bool, text: str, out: Emitter) -> None:
        if not text:
            return
        if not reasoning:
            out.content.append(text)
        elif self._released:
            out.reasoning.append(text)
        else:
            self._held.append(text)
            self._held_chars += len(text)
            if self._holdback is not None and self._held_chars > self._holdback:
                self._release(out)

    def _release(self, out: Emitter) -> None:
        out.reasoning.extend(self._held)
        self._held, self._held_chars = [], 0
        self._released = True
