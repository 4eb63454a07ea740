"""Incremental text of a ByteLevel tokenizer's ids in O(1) per id (DeepSeek's tokenizers and the embedded one).

A ``tokenizers`` ``ByteLevel`` decoder maps each token's symbols back to bytes through GPT-2's byte table (a token
with a symbol outside the table contributes its own UTF-8 bytes), joins the bytes of all ids, and decodes them as
UTF-8 with every invalid sequence replaced by U+FFFD (Rust's ``String::from_utf8_lossy``, the Unicode "maximal
subpart" practice). The text of a stream of ids is therefore a function of their bytes alone, and Python's
incremental UTF-8 decoder with ``errors="replace"`` produces it byte run by byte run: each complete character (or
replacement of an invalid sequence) as soon as it is determined, an incomplete trailing sequence held back. So a run
of invalid bytes costs one step per id, where ``DecodeStream`` holds every id after it back and re-decodes the whole
run each step (the general path, :mod:`v41.engine.detokenizer`).

``tests/test_byte_level_text.py`` checks this against ``Tokenizer.decode`` (the library, not this module) on every id
of the embedded tokenizer and on random id sequences with invalid and split bytes, and the detokenizer through it
against the ``DecodeStream`` path.
"""

from __future__ import annotations

import codecs
import weakref

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel


def _byte_table() -> dict[str, int]:
    """GPT-2's symbol → byte table of the ByteLevel pre-tokenizer and decoder (the 188 printable Latin-1 bytes
    stand for themselves, the other 68 for code points 256 onwards in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + extra)] = b
            extra += 1
    return table


SYMBOL_BYTE = _byte_table()  # symbol → byte
BYTE_SYMBOL = {b: s for s, b in SYMBOL_BYTE.items()}  # byte → symbol (what the pre-tokenizer writes)


# Per tokenizer (weakly held): its special ids and two id → bytes caches (special tokens skipped / kept), shared by
# the requests' decoders (a tokenizer with hundreds of added tokens would otherwise cost each request their scan).
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _table(tokenizer: Tokenizer) -> tuple[frozenset[int], dict[int, bytes], dict[int, bytes]]:
    table = _TABLES.get(tokenizer)
    if table is None:
        special = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        table = _TABLES[tokenizer] = (special, {}, {})
    return table


def is_byte_level(tokenizer: Tokenizer) -> bool:
    """Whether :class:`ByteLevelText` decodes ``tokenizer`` as ``Tokenizer.decode`` does: its decoder is exactly a
    ``ByteLevel`` decoder (not a ``Sequence`` with other steps)."""
    return isinstance(tokenizer.decoder, ByteLevel)


class ByteLevelText:
    """The text that ids add, one id at a time: ``push(id)`` returns the characters that id completes.

    ``tokenizer``: one for which :func:`is_byte_level` holds; ``skip_special_tokens``: special added tokens add
    nothing (as in ``Tokenizer.decode``); ``context_ids``: ids decoded first, never returned (the prompt's last ids).
    A character that the first pushed ids complete belongs to the context and is not returned either (nor are the
    replacement characters of an invalid sequence the context ends in). Ids with no token add nothing. The bytes of
    an unfinished character at the end are held back (``pending``) until later bytes complete or break it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, context_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._special, skipped, kept = _table(tokenizer)
        self._bytes = skipped if skip_special_tokens else kept
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for i in context_ids:
            self._decode(self.token_bytes(i))
        # A context that ends inside a character: the characters its held bytes become (the completed one, or the
        # replacements of an invalid run: as many as those bytes decode to alone) are the context's.
        self._drop = len(codecs.decode(self._utf8.getstate()[0], "utf-8", "replace"))

    @property
    def pending(self) -> bool:
        """Whether bytes of an unfinished character are held back."""
        return bool(self._utf8.getstate()[0])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to the decoded byte string (b"" for a skipped special token or an id with no
        token)."""
        b = self._bytes.get(token_id)
        if b is None:
            token = self._tokenizer.id_to_token(token_id)
            if token is None or (self._skip_special and token_id in self._special):
                b = b""
            else:
                try:
                    b = bytes(SYMBOL_BYTE[c] for c in token)
                except KeyError:  # a symbol outside the table: the token's own UTF-8 (the Rust decoder's rule)
                    b = token.encode("utf-8")
            self._bytes[token_id] = b
        return b

    def _decode(self, data: bytes) -> str:
        """The characters ``data`` completes. Python's decoder holds a surrogate's first two bytes (ED A0..BF) as if
        they could still begin a character, where Rust's decoder has already replaced them: bytes held that decode
        alone to more than one character (a character's prefix decodes alone to one U+FFFD) are final, and go now."""
        text = self._utf8.decode(data)
        held = self._utf8.getstate()[0]
        if len(held) > 1 and len(alone := codecs.decode(held, "utf-8", "replace")) > 1:
            text += alone
            self._utf8.reset()
        return text

    def push(self, token_id: int) -> str:
        """The characters ``token_id`` completes (possibly ""), U+FFFD for each invalid sequence."""
        text = self._decode(self.token_bytes(token_id))
        if self._drop and text:
            k = min(self._drop, len(text))
            text, self._drop = text[k:], self._drop - k
        return text
