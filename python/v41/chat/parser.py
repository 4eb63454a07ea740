"""Incremental output parser: generated ids -> reasoning, content and tool calls, streamed or not.

Source: docs/model.md §7.10; docs/known-failures.md KF-01..KF-04. The rules live in ``reasoning.py`` (start
state, ``</think>``, EOS, the KF-03 policy) and ``dsml.py`` (tool blocks); this module decodes ids
incrementally and drives the two over one text buffer.

Invariant: the result never depends on how the output is split into ``feed`` calls -- the machine only acts
on text no later text can change (partial markers, the ``\\n\\n`` before a possible tool block and a
partial UTF-8 character are held back), so feeding everything at once, one token at a time or any other
split gives the same ``ParserResult``, and the deltas concatenate to it.

Use ``feed`` (token ids) or ``feed_text`` (decoded text, e.g. in tests), not both on one parser.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer

from ..engine.detokenizer import IncrementalDetokenizer
from .deltas import Emitter, ParserDelta, ParserResult
from .dsml import DsmlParser, declared_properties
from .formats import V41, profile
from .reasoning import DEFAULT_HOLDBACK_CHARS, Phase, ReasoningSplitter, start_phase
from .tokens import ChatTokenizer, chat_tokenizer


class OutputParser:
    """Parses one completion.

    ``tokenizer``: a ``tokenizers.Tokenizer`` or model directory (None: text-only, ``feed_text`` only).
    ``thinking``: the request's effective thinking flag (None = model default, on); used for the start
    state unless ``prompt_ids`` decides it (§7.10). ``tools``: the request's tool definitions; DSML blocks
    are parsed only when it is non-empty (else they stay content), and their ``parameters`` schemas decide
    whether a lone ``{"arguments": {...}}`` is unwrapped (``dsml.py``). ``prompt_ids``: the prompt, for the
    start state and as decoding context. ``revision``: format revision (default from the model directory).
    ``reasoning_holdback_chars``: KF-03 hold-back (see ``reasoning.py``). ``call_id_prefix``: tool-call ids
    become ``prefix + index`` (default ``call_`` + random hex + ``_``).

    Errors: ``RuntimeError`` on ``feed`` after ``finish`` or ``feed`` without a tokenizer.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str | os.PathLike[str] | None,
        thinking: bool | None = None,
        tools: Sequence[Any] | None = None,
        prompt_ids: Sequence[int] | None = None,
        revision: str | None = None,
        reasoning_holdback_chars: int | None = DEFAULT_HOLDBACK_CHARS,
        call_id_prefix: str | None = None,
    ) -> None:
        self._tok: ChatTokenizer | None = None
        marker_ids: dict[str, int] = {}
        if tokenizer is not None:
            self._tok = chat_tokenizer(tokenizer, revision)
            marker_ids = self._tok.marker_ids
        else:
            profile(revision or V41)
            if prompt_ids:
                raise ValueError("prompt_ids need a tokenizer")
        self._phase = start_phase(prompt_ids, marker_ids, True if thinking is None else thinking)
        self._detok = (
            IncrementalDetokenizer(self._tok.tokenizer, list(prompt_ids or []), skip_special_tokens=False)
            if self._tok is not None
            else None
        )
        prefix = call_id_prefix if call_id_prefix is not None else f"call_{uuid.uuid4().hex[:24]}_"
        self._splitter = ReasoningSplitter(tools=bool(tools), holdback_chars=reasoning_holdback_chars)
        self._dsml = DsmlParser(lambda i: f"{prefix}{i}", declared_properties(tools))
        self._buf = ""
        self._out = Emitter()
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._finished = False

    # ------------------------------------------------------------------ public

    def feed(self, token_ids: Iterable[int]) -> ParserDelta:
        """Add generated ids; return what became certain."""
        if self._detok is None:
            raise RuntimeError("feed() needs a tokenizer; use feed_text()")
        self._check_open()
        text, _ = self._detok.push(token_ids)
        return self._push(text, final=False)

    def feed_text(self, text: str) -> ParserDelta:
        """Add generated text directly (tests, or callers that detokenize themselves)."""
        self._check_open()
        return self._push(text, final=False)

    def finish(self) -> ParserResult:
        """End of generation: release held text, close an open call, return the whole result."""
        self._check_open()
        tail = self._detok.flush() if self._detok is not None else ""
        self._push(tail, final=True, collect=False)
        if self._phase is Phase.REASONING:
            self._splitter.end_unterminated(self._out)
        elif self._phase is Phase.TOOLS:
            self._dsml.close(self._out)
        self._phase = Phase.END
        self._finished = True
        final = self._collect()
        reasoning = "".join(self._reasoning)
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self._dsml.calls
        ]
        return ParserResult(reasoning or None, "".join(self._content), calls, final, self._dsml.truncated)

    def feed_engine_output(
        self, token_ids: Sequence[int], finish_reason: str | None, stop_reason: int | str | None
    ) -> tuple[list[ParserDelta], ParserResult | None]:
        """One engine delta of this completion (the fields of a ``CompletionOutput``): feeds the new ids
        except the EOS / stop token id that ended generation (finish "stop" without a stop *string*: that
        token is no text), and finishes once ``finish_reason`` is set. Returns the deltas to send (the last
        one the final delta) and the whole result (None until finished)."""
        ids = list(token_ids)
        if finish_reason == "stop" and ids and not isinstance(stop_reason, str):
            ids = ids[:-1]
        deltas = [self.feed(ids)] if ids else []
        if finish_reason is None:
            return deltas, None
        result = self.finish()
        return deltas + [result.final_delta], result

    def reasoning_tokens(self, token_ids: Sequence[int], result: ParserResult) -> int:
        """Generated tokens before ``</think>`` in ``token_ids`` (all of them when reasoning never closed); 0
        when ``result`` has no reasoning (OpenAI ``completion_tokens_details.reasoning_tokens``)."""
        if not result.reasoning_content:
            return 0
        close = self._tok.tokenizer.token_to_id("</think>") if self._tok is not None else None
        ids = list(token_ids)
        return ids.index(close) if close is not None and close in ids else len(ids)

    # ------------------------------------------------------------------ driver

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("OutputParser used after finish()")

    def _push(self, text: str, final: bool, collect: bool = True) -> ParserDelta:
        self._buf += text
        while self._buf or final:
            before = (self._phase, self._dsml.state)
            if self._phase is Phase.END:
                self._buf = ""
                break
            if self._phase is Phase.TOOLS:
                consumed, event = self._dsml.step(self._buf, final, self._out)
                if event == "done":
                    self._phase = Phase.CONTENT
                elif event == "end":
                    self._dsml.close(self._out)
                    self._phase = Phase.END
            else:
                consumed, self._phase = self._splitter.step(self._phase, self._buf, final, self._out)
                if self._phase is Phase.TOOLS and before[0] is not Phase.TOOLS:
                    self._dsml.begin()
            self._buf = self._buf[consumed:]
            if not consumed and (self._phase, self._dsml.state) == before:
                break
        return self._collect() if collect else ParserDelta()

    def _collect(self) -> ParserDelta:
        delta = self._out.take()
        self._reasoning.append(delta.reasoning_delta)
        self._content.append(delta.content_delta)
        return delta
