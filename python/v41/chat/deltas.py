"""Output types of the incremental output parser, and the per-feed accumulator.

Source: docs/model.md §7.10; OpenAI chat-completions shapes (``tool_calls`` items and streaming
``delta.tool_calls`` items).

Invariant (checked by the tests): concatenating every ``ParserDelta`` returned by ``feed`` plus
``ParserResult.final_delta`` gives exactly the ``ParserResult`` fields, whatever the split of the input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed tool-call fragment. The first fragment of a call carries ``id`` and ``name`` (and
    possibly the first argument text); later ones only ``arguments`` text to append."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """OpenAI streaming shape: ``{"index", "id", "type", "function": {"name", "arguments"}}``."""
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            fn = {"name": self.name, **fn}
        out["function"] = fn
        return out


@dataclass(frozen=True, slots=True)
class ParserDelta:
    """New output of one ``feed`` (or the tail flushed by ``finish``)."""

    reasoning_delta: str = ""
    content_delta: str = ""
    tool_call_deltas: list[ToolCallDelta] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.reasoning_delta or self.content_delta or self.tool_call_deltas)


@dataclass(frozen=True, slots=True)
class ParserResult:
    """The whole parsed completion.

    ``reasoning_content``: None when there was none (thinking off, or empty); ``content``: the answer
    text; ``tool_calls``: OpenAI ``tool_calls`` items with ``function.arguments`` as a JSON string (always
    strict JSON); ``final_delta``: what ``finish`` released (send it as the last streamed chunk); not
    compared, so results of different splits compare equal. ``truncated_call``: generation ended inside
    the last call (docs/model.md §7.10a): it holds only what was complete and must not be run as if whole.
    """

    reasoning_content: str | None
    content: str
    tool_calls: list[dict[str, Any]]
    final_delta: ParserDelta = field(default_factory=ParserDelta, compare=False)
    truncated_call: bool = False

    def finish_reason(self, engine_reason: str = "stop") -> str:
        """OpenAI finish reason: ``tool_calls`` when the model stopped after calling tools, every call whole;
        the engine's reason (``stop``, ``length``) when the last call was cut off (§7.10a)."""
        whole = self.tool_calls and not self.truncated_call
        return "tool_calls" if whole and engine_reason == "stop" else engine_reason


class Emitter:
    """Collects output during one ``feed``; consecutive fragments of one call merge into one delta."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_deltas: list[ToolCallDelta] = []

    def call_fragment(self, index: int, arguments: str, call_id: str | None = None, name: str | None = None) -> None:
        last = self.tool_deltas[-1] if self.tool_deltas else None
        if last is not None and last.index == index and call_id is None:
            last.arguments += arguments
        else:
            self.tool_deltas.append(ToolCallDelta(index, call_id, name, arguments))

    def take(self) -> ParserDelta:
        delta = ParserDelta("".join(self.reasoning), "".join(self.content), self.tool_deltas)
        self.reasoning, self.content, self.tool_deltas = [], [], []
        return delta
