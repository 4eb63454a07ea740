"""``v41.engine.byte_level_text`` (the O(1)-per-id text of ByteLevel tokenizers) against the ``tokenizers`` library's
own ``Tokenizer.decode``, and the detokenizer through it against the ``DecodeStream`` path it replaces there."""

from __future__ import annotations

import codecs
import random

import pytest
from tokenizers import Tokenizer, decoders

from v41.engine.byte_level_text import BYTE_SYMBOL, SYMBOL_BYTE, ByteLevelText, is_byte_level
from v41.engine.detokenizer import IncrementalDetokenizer
from v41.testing.tokenizer_files import load_tiny_tokenizer

TOK = load_tiny_tokenizer()
BYTE_IDS = [TOK.token_to_id(symbol) for symbol in SYMBOL_BYTE]  # one id per byte value
FFFD = "\ufffd"


def _generic_twin() -> Tokenizer:
    """The same tokenizer with its ByteLevel decoder inside a Sequence: decodes alike, takes the DecodeStream path."""
    tok = Tokenizer.from_str(TOK.to_str())
    tok.decoder = decoders.Sequence([decoders.ByteLevel()])
    return tok


def _random_ids(rng: random.Random, n: int) -> list[int]:
    """Lone bytes (split characters, invalid runs, surrogate halves) mixed with whole tokens, specials and ids past
    the vocabulary."""
    vocab = TOK.get_vocab_size()
    return [rng.choice(BYTE_IDS) if rng.random() < 0.6 else rng.randrange(vocab + 2) for _ in range(n)]


def test_the_table_covers_every_byte_and_the_embedded_tokenizer_is_byte_level():
    assert sorted(SYMBOL_BYTE.values()) == list(range(256)) and None not in BYTE_IDS
    for b in range(256):  # the inverse table names the library's byte tokens
        assert TOK.decode([TOK.token_to_id(BYTE_SYMBOL[b])]) == bytes([b]).decode("utf-8", "replace"), b
    assert is_byte_level(TOK) and not is_byte_level(_generic_twin())


@pytest.mark.parametrize("skip", [True, False])
def test_every_id_alone_has_the_librarys_text(skip):
    text = ByteLevelText(TOK, skip, [])
    for i in range(TOK.get_vocab_size() + 3):
        assert text.token_bytes(i).decode("utf-8", "replace") == TOK.decode([i], skip_special_tokens=skip), i


def test_random_streams_after_a_context_have_the_librarys_text():
    """Pushed one id at a time after a context of 0–6 ids: the text returned is ``decode(context + ids)`` past
    ``decode(context)``, less what the bytes still held back decode to."""
    rng = random.Random(7)
    for _ in range(4000):
        ctx, ids, skip = _random_ids(rng, rng.randint(0, 6)), _random_ids(rng, rng.randint(1, 30)), rng.random() < 0.5
        text = ByteLevelText(TOK, skip, ctx)
        out = "".join(text.push(i) for i in ids)
        held = len(codecs.decode(text._utf8.getstate()[0], "utf-8", "replace"))
        full = TOK.decode(ctx + ids, skip_special_tokens=skip)
        assert out == full[len(TOK.decode(ctx, skip_special_tokens=skip)):len(full) - held], (ctx, ids, skip)
        assert text.pending == (held > 0)


def test_a_surrogates_first_two_bytes_are_replaced_when_they_arrive():
    """ED A0..BF can begin no character (Rust's decoder replaces both bytes at once; Python's would hold them until a
    third byte): "A", ED, A0 hands out U+FFFD twice on A0, as Tokenizer.decode reads them, and flush drops nothing."""
    ed, a0, cont = (TOK.token_to_id(BYTE_SYMBOL[b]) for b in (0xED, 0xA0, 0x80))
    d = IncrementalDetokenizer(TOK, [])
    assert [d.push([i])[0] for i in (TOK.token_to_id("A"), ed, a0, cont)] == ["A", "", FFFD * 2, FFFD]
    assert d.flush() == "" and d.text == TOK.decode([TOK.token_to_id("A"), ed, a0, cont])
    primed = ByteLevelText(TOK, True, [ed, a0])  # a context ending in them: theirs, not the output's
    assert not primed.pending and primed.push(cont) == FFFD


def test_a_run_of_invalid_bytes_streams_one_replacement_per_id():
    """5,000 lone continuation bytes: each push hands out its U+FFFD at once (the DecodeStream path holds every one
    back and re-decodes the whole run each token)."""
    d = IncrementalDetokenizer(TOK, [])
    lone = TOK.token_to_id(BYTE_SYMBOL[0x80])
    assert all(d.push([lone]) == (FFFD, None) for _ in range(5000))
    assert d.flush() == "" and d.text == FFFD * 5000
    generic = IncrementalDetokenizer(_generic_twin(), [])
    assert all(generic.push([lone]) == ("", None) for _ in range(50))


def test_the_detokenizer_gives_the_decode_stream_paths_text_and_stops():
    """Random prompts, outputs (ending on a whole character, where both paths have released everything), stop
    strings and groupings into pushes: the same deltas joined, the same stop, the same ids."""
    rng = random.Random(11)
    twin = _generic_twin()
    a_id = TOK.token_to_id("a")
    for _ in range(1500):
        prompt, ids = _random_ids(rng, rng.randint(0, 8)), _random_ids(rng, rng.randint(1, 25)) + [a_id]
        sample = TOK.decode(ids).replace(FFFD, "")  # a stop with U+FFFD in it: the paths see it complete on
        k = rng.randrange(len(sample))           # different ids (an invalid byte is known invalid earlier here)
        stop = [sample[k:k + rng.randint(1, 3)]] if rng.random() < 0.4 else None
        kw = dict(skip_special_tokens=rng.random() < 0.7, stop=stop, include_stop_str_in_output=rng.random() < 0.5)
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, len(ids) - 1)))
        groups = [ids[i:j] for i, j in zip([0, *cuts], [*cuts, len(ids)])]
        got = []
        for tok in (TOK, twin):
            d = IncrementalDetokenizer(tok, prompt, **kw)
            deltas, hit = [], None
            for g in groups:
                delta, hit = d.push(g)
                deltas.append(delta)
                if hit is not None:
                    break
            deltas.append(d.flush())
            got.append(("".join(deltas), hit, d.token_ids))
        assert got[0] == got[1], (prompt, ids, kw)
