"""Incremental detokenization with stop strings (one instance per completion).

A tokenizer whose decoder is ``ByteLevel`` (DeepSeek's, the embedded model's) decodes through
:class:`~v41.engine.byte_level_text.ByteLevelText`: each id's bytes into an incremental UTF-8 decoder, O(1) per id,
invalid bytes included (each becomes U+FFFD as soon as it is known invalid). Any other tokenizer decodes through
``tokenizers``' own streaming decoder, :class:`tokenizers.decoders.DecodeStream` (one call into Rust
per token), primed with the last ``INITIAL_CONTEXT_TOKENS`` prompt tokens as left context, as follows. It keeps vLLM's
prefix-offset window: the text of a new token is ``decode(ids[prefix:]) - decode(ids[prefix:read])``, and the
window moves forward each time the decoded text ends on a whole character. While the text ends in U+FFFD (a
multi-byte character whose bytes are split across tokens) the stream returns nothing; the complete characters
before the split one are then decoded here and handed out at once (:meth:`IncrementalDetokenizer._held_text`), and
the split character when it completes, so no replacement character is ever emitted for a split character, and a
stop string in the text before it is found on that token. Some tokenizers decode a longer id sequence to text that
does not start with the shorter one's (vLLM issue 17448); the stream then raises
"Invalid prefix encountered", and the detokenizer starts a new stream and decodes the held-back ids again
(:meth:`IncrementalDetokenizer._step`; text already emitted is never taken back).

Stop strings are matched on the complete decoded text, across token boundaries (KF-11):

* any suffix of the text that could be the start of a stop string is held back, and released as soon as
  it can no longer start one;
* when a stop string completes, the text ends just before it (or just after it with
  ``include_stop_str_in_output``) and nothing more is emitted; when several complete on the same token,
  the one ending first wins (then the one starting first), as if the text had arrived a character at a
  time;
* :meth:`IncrementalDetokenizer.flush` at the end releases held-back text that turned out not to be a
  stop; a trailing incomplete character is dropped, never emitted.

Invariant: the concatenation of every delta returned by ``push`` and ``flush`` equals
:attr:`IncrementalDetokenizer.text`, and it is the same whatever the grouping of the ids into pushes.
Cost per token: a dictionary lookup and an incremental UTF-8 decode (ByteLevel), or one ``DecodeStream.step`` (two
decodes of a short window, in Rust) and two more decodes from Python while a character is split; plus O(sum
len(stop)^2). The text already released is kept as a list of parts, so a token never copies the whole output
(:meth:`text_since`). benches/RESULTS.md "2026-12-05 (CPU)" and "2026-12-05 (late, CPU only)" have the figures.
Limitations of the ``DecodeStream`` path only: a genuine U+FFFD at the very end of the output is indistinguishable
from a split character and is dropped at ``flush``; bytes that complete no character keep every later id held back,
and each token re-decodes the whole run (quadratic in such an output).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from .byte_level_text import ByteLevelText, is_byte_level

INITIAL_CONTEXT_TOKENS = 5  # prompt tokens decoded as left context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
_REPLACEMENT = "\ufffd"
_INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error when the decoded text is not monotonic


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas, applying stop strings.

    ``tokenizer``: a ``tokenizers.Tokenizer``; ``prompt_ids``: the prompt (its last tokens are decoding
    context only, never emitted); ``skip_special_tokens``: drop special tokens from the text; ``stop``:
    stop strings (non-empty); ``include_stop_str_in_output``: keep the matched stop string in the text.

    Errors: ``ValueError`` for an empty stop string; ``RuntimeError`` on ``push`` after ``flush``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = list(stop or [])
        if any(not s for s in self._stops):
            raise ValueError("stop cannot contain an empty string")
        self._stop_prefix_chars = frozenset("".join(s[:-1] for s in self._stops))
        self._include_stop = include_stop_str_in_output
        self._context = list(prompt_ids[-INITIAL_CONTEXT_TOKENS:]) if INITIAL_CONTEXT_TOKENS else []
        self._bytes = ByteLevelText(tokenizer, skip_special_tokens, self._context) if is_byte_level(tokenizer) else None
        self._stream = None if self._bytes else DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)
        self._held = 0  # ids at the end of token_ids whose text the stream has not returned (_step)
        self._held_released = 0  # chars of their text handed out before the stream returned it (_held_text)
        # A context whose text ends in U+FFFD (a prompt cut mid-character, or a genuine U+FFFD) leaves the stream's
        # prefix empty: its first text then repeats the context's, whose length is skipped there (as before, the
        # character that the first ids complete belongs to the prompt).
        context_text = "" if self._bytes else self._decode(self._context)
        self._skip = len(context_text) if context_text.endswith(_REPLACEMENT) else 0
        # The decoded output text is "".join(_parts) + _pending: _parts the deltas handed out (_ends[i]: the text's
        # length after part i), _pending the text past them (held back; may run past a stop until truncated). No
        # stop string starts inside released text (_safe_len holds back every suffix that could start one), so
        # stops are matched in _pending alone.
        self._parts: list[str] = []
        self._ends: list[int] = []
        self._pending = ""
        self._emitted = 0  # chars handed out so far
        self._stop_hit: str | None = None
        self._flushed = False
        self.token_ids: list[int] = []  # ids pushed, up to and including the one completing a stop

    # ----------------------------------------------------------------- public

    @property
    def text(self) -> str:
        """Text emitted so far (the final output text once finished). O(its length): per step, use
        :meth:`text_since`."""
        return "".join(self._parts)

    @property
    def emitted_chars(self) -> int:
        """Length of :attr:`text`."""
        return self._emitted

    def text_since(self, pos: int) -> str:
        """``text[pos:]``, in O(the result's length) when ``pos`` is an earlier :attr:`emitted_chars`."""
        i = bisect_left(self._ends, pos + 1)  # the first part ending past pos
        if i == len(self._parts):
            return ""
        start = self._ends[i] - len(self._parts[i])
        return self._parts[i][pos - start:] + "".join(self._parts[i + 1:])

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_hit

    @property
    def finished(self) -> bool:
        """True once a stop string was hit or :meth:`flush` was called."""
        return self._stop_hit is not None or self._flushed

    def push(self, token_ids: Iterable[int]) -> tuple[str, str | None]:
        """Add generated ids; return ``(delta_text, stop_hit)``.

        ``delta_text``: newly releasable text (possibly ""). ``stop_hit``: the stop string matched by this
        push (or an earlier one), else None. Ids after the one completing a stop are ignored, and once a
        stop is hit every later push returns ``("", stop_hit)``.
        """
        if self._flushed:
            raise RuntimeError("push() after flush()")
        if self._stop_hit is not None:
            return "", self._stop_hit
        released = []
        for t in token_ids:
            t = int(t)
            self.token_ids.append(t)
            new = self._next_text(t)
            if not new:
                continue
            if not self._stops:
                released.append(self._release_text(new))
                continue
            start = len(self._pending)
            self._pending += new
            hit = self._find_stop(start)
            if hit is not None:
                stop, pos = hit
                end = pos + len(stop) if self._include_stop else pos
                self._pending = self._pending[:end]
                self._stop_hit = stop
                released.append(self._release(end))
                return "".join(released), stop
            released.append(self._release(self._safe_len()))  # the pending text stays shorter than a stop
        return "".join(released), None

    def flush(self) -> str:
        """End of generation: release held-back text that is not a stop (never a partial character)."""
        if self._flushed or self._stop_hit is not None:
            self._flushed = True
            return ""
        self._flushed = True
        return self._release(len(self._pending))

    # ----------------------------------------------------------------- decoding

    def _next_text(self, token_id: int) -> str:
        """The text that ``token_id`` (the last of :attr:`token_ids`) adds: what the stream returns, past what was
        handed out early; while the stream holds text back (a character split across tokens), the complete
        characters before the split one (:meth:`_held_text`); "" for a skipped special token. ByteLevel: the
        characters the id completes."""
        if self._bytes is not None:
            return self._bytes.push(token_id)
        new = self._step(token_id)
        if new is None:
            self._held += 1
            complete = self._held_text().rstrip(_REPLACEMENT)
            delta = complete[self._held_released:]
            self._held_released = max(self._held_released, len(complete))
            return delta
        if self._skip:
            new, self._skip = new[self._skip:], 0
        delta = new[self._held_released:]
        self._held, self._held_released = 0, 0
        return delta

    def _held_text(self) -> str:
        """The text of the held-back ids after their ``INITIAL_CONTEXT_TOKENS`` predecessors (prompt ids included):
        ``decode(context + held)`` past the length of ``decode(context)``, as the stream will return it (by length, as
        the Python window did: a prompt's unfinished character that the output finishes keeps its one character).
        Two decodes, only while a character is split."""
        n = len(self.token_ids) - self._held  # token_ids[n:]: the held-back ids
        before = self.token_ids[max(0, n - INITIAL_CONTEXT_TOKENS):n]
        if len(before) < INITIAL_CONTEXT_TOKENS:
            before = (self._context + before)[-INITIAL_CONTEXT_TOKENS:] if INITIAL_CONTEXT_TOKENS else []
        prefix, full = self._decode(before), self._decode(before + self.token_ids[n:])
        return full[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _step(self, token_id: int) -> str | None:
        """``DecodeStream.step``; on "Invalid prefix encountered" (module docstring) a new, unprimed stream decodes
        the held-back ids and ``token_id`` (an empty prefix cannot be violated; without left context a decoder
        that strips a leading space may drop that one space). Errors: other ``DecodeStream`` errors propagate."""
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception as e:  # tokenizers raises a plain Exception
            if not str(e).startswith(_INVALID_PREFIX):
                raise
        self._stream, self._skip = DecodeStream(skip_special_tokens=self._skip_special_tokens), 0
        return self._stream.step(self._tokenizer, self.token_ids[-self._held - 1:])

    # ----------------------------------------------------------------- stop strings

    def _find_stop(self, start: int) -> tuple[str, int] | None:
        """The stop occurrence ending first among those ending past ``start`` of the pending text: (stop, its
        start index in the pending text)."""
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            i = self._pending.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[2], best[1])

    def _safe_len(self) -> int:
        """Length of the pending text that can no longer be part of a stop string (the rest is held back)."""
        n = len(self._pending)
        if not n or self._pending[-1] not in self._stop_prefix_chars:
            return n  # a held-back suffix ends in a character of some stop's proper prefix
        safe = n
        for s in self._stops:
            for k in range(min(len(s) - 1, n), 0, -1):
                if self._pending.endswith(s[:k]):
                    safe = min(safe, n - k)
                    break
        return safe

    def _release(self, end: int) -> str:
        """Hands out the first ``end`` chars of the pending text."""
        delta, self._pending = self._pending[:end], self._pending[end:]
        return self._release_text(delta)

    def _release_text(self, delta: str) -> str:
        """Hands out ``delta`` (text past what was handed out; no stop strings, or already checked)."""
        if delta:
            self._emitted += len(delta)
            self._parts.append(delta)
            self._ends.append(self._emitted)
        return delta
