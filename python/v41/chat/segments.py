"""A prompt under construction: an ordered list of plain-text runs and control markers.

Source: docs/numerics.md §4 (tokenization of chat prompts), docs/model.md §7.2. The encoder never builds the
prompt as one string to be re-tokenized: it records *what* each piece is, so that scaffolding markers become
their token ids while message text stays plain text even when it spells a control token.

Three kinds of input:

* :meth:`PromptBuilder.marker` -- one control marker (a single token id);
* :meth:`PromptBuilder.text` -- message data (content, names, JSON): always plain text;
* :meth:`PromptBuilder.template` -- fixed format text (tools preamble, DSML tags): every control marker it
  contains becomes its token id, the rest is plain text, as the reference tokenizer would split it.

Adjacent plain pieces merge into one run; :meth:`PromptBuilder.runs` yields the maximal runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .formats import CONTROL_MARKERS, IMAGE

_MARKER_RE = re.compile("(" + "|".join(re.escape(m) for m in sorted(CONTROL_MARKERS, key=len, reverse=True)) + ")")


@dataclass(frozen=True, slots=True)
class Marker:
    """One control marker, inserted as its token id."""

    text: str


@dataclass(slots=True)
class PromptBuilder:
    """Ordered prompt pieces; ``images`` holds the image blocks in prompt order (one per IMAGE marker)."""

    pieces: list[str | Marker] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)

    def marker(self, marker: str) -> None:
        self.pieces.append(Marker(marker))

    def text(self, text: str) -> None:
        if text:
            self.pieces.append(text)

    def template(self, text: str) -> None:
        for i, piece in enumerate(_MARKER_RE.split(text)):
            if i % 2:
                self.marker(piece)
            else:
                self.text(piece)

    def image(self, block: Any) -> None:
        """An image placeholder marker; ``block`` (the request's image part) is returned with the prompt."""
        self.marker(IMAGE)
        self.images.append(block)

    def render(self) -> str:
        """The prompt as the reference encoder's string."""
        return "".join(p.text if isinstance(p, Marker) else p for p in self.pieces)

    def runs(self) -> Iterator[str | Marker]:
        """Markers and maximal plain-text runs, in order."""
        run: list[str] = []
        for p in self.pieces:
            if isinstance(p, Marker):
                if run:
                    yield "".join(run)
                    run = []
                yield p
            else:
                run.append(p)
        if run:
            yield "".join(run)
