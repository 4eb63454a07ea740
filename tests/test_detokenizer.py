"""Tests for ``v41.engine.detokenizer`` (incremental text, stop strings across tokens; KF-11)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v41.engine.byte_level_text import BYTE_SYMBOL, SYMBOL_BYTE
from v41.engine.detokenizer import IncrementalDetokenizer
from v41.testing.tokenizer_files import load_tiny_tokenizer

TOK = load_tiny_tokenizer()
FFFD = "\ufffd"

KF11_PROMPT = "Here is the English alphabet: ABC"
KF11_CONTINUATION = "DEFGHIJKLM"
KF11_STOP = "DEFGHIJ"


def byte_ids(text: str) -> list[int]:
    """One token per UTF-8 byte: splits every multi-byte character across tokens."""
    return [TOK.token_to_id(BYTE_SYMBOL[b]) for b in text.encode("utf-8")]


def char_ids(text: str) -> list[int]:
    """Each character tokenized on its own."""
    return [i for ch in text for i in TOK.encode(ch).ids]


def bpe_ids(text: str) -> list[int]:
    return TOK.encode(text).ids


def continuation_ids(prompt: str, continuation: str) -> list[int]:
    """Tokens of ``prompt + continuation`` after the prompt's own tokens (the model's view of the stream)."""
    p = bpe_ids(prompt)
    full = bpe_ids(prompt + continuation)
    assert full[: len(p)] == p
    return full[len(p) :]


def groupings(ids: list[int]):
    """Every way to cut ``ids`` into consecutive non-empty pushes (2**(n-1) of them)."""
    n = len(ids)
    for cuts in itertools.product((False, True), repeat=max(n - 1, 0)):
        groups, cur = [], []
        for i, t in enumerate(ids):
            cur.append(t)
            if i == n - 1 or cuts[i]:
                groups.append(cur)
                cur = []
        yield groups


def some_groupings(ids: list[int], seed: int, count: int = 12):
    """One-by-one, all at once, every two-way cut, and ``count`` random groupings."""
    yield [[t] for t in ids]
    yield [list(ids)]
    for k in range(1, len(ids)):
        yield [ids[:k], ids[k:]]
    rng = random.Random(seed)
    for _ in range(count):
        groups, i = [], 0
        while i < len(ids):
            j = i + rng.randint(1, 4)
            groups.append(ids[i:j])
            i = j
        yield groups


def stream(groups, prompt_ids=(), **kw) -> tuple[list[str], str, str | None, IncrementalDetokenizer]:
    """Push ``groups``; stop pushing after a stop hit (as the engine does); return (deltas, flushed, stop, d).
    Checks on the way that ``text_since`` of the previous length is each delta (what the engine's outputs send)."""
    d = IncrementalDetokenizer(TOK, list(prompt_ids), **kw)
    deltas, stop = [], None
    for g in groups:
        before = d.emitted_chars
        delta, stop = d.push(g)
        assert d.text_since(before) == delta and d.emitted_chars == before + len(delta)
        deltas.append(delta)
        if stop is not None:
            break
    before = d.emitted_chars
    tail = d.flush()
    assert d.text_since(before) == tail and d.text_since(0) == d.text == "".join(deltas) + tail
    assert all(d.text_since(k) == d.text[k:] for k in range(len(d.text) + 1))
    return deltas, tail, stop, d


# --------------------------------------------------------------------------- multi-byte characters

MULTIBYTE_TEXTS = [
    "今天天气很好，我们去公园散步吧。",
    "emoji 😀🚀 and a family 👨‍👩‍👧 🇯🇵!",
    "Crème brûlée, Łódź, naïve — done",
    "mixed 中文 text with 😀 inside",
]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("tokenize", [bpe_ids, byte_ids, char_ids])
def test_every_split_streams_the_exact_text_and_never_a_replacement_char(text, tokenize):
    ids = tokenize(text)
    prompt = bpe_ids("Prompt 你好 ")
    for groups in some_groupings(ids, seed=len(text)):
        deltas, tail, stop, d = stream(groups, prompt)
        assert stop is None
        assert all(FFFD not in x for x in [*deltas, tail])
        assert "".join(deltas) + tail == text == d.text


def test_a_trailing_incomplete_character_is_dropped_not_emitted():
    ids = byte_ids("ab😀")[:-1]  # generation ended in the middle of the emoji
    deltas, tail, _, d = stream([[t] for t in ids])
    assert "".join(deltas) + tail == "ab" == d.text


def test_skip_special_tokens_controls_special_token_text():
    ids = bpe_ids("hi") + [1]  # EOS id
    assert stream([ids], skip_special_tokens=True)[3].text == "hi"
    assert stream([ids], skip_special_tokens=False)[3].text == "hi<｜end▁of▁sentence｜>"


# --------------------------------------------------------------------------- KF-11 stop strings


@pytest.mark.parametrize("tokenize", ["model", "char", "byte"])
@pytest.mark.parametrize("include", [False, True])
def test_kf11_stop_string_is_never_streamed_before_it_completes(tokenize, include):
    cont = {
        "model": continuation_ids(KF11_PROMPT, KF11_CONTINUATION),
        "char": char_ids(KF11_CONTINUATION),
        "byte": byte_ids(KF11_CONTINUATION),
    }[tokenize]
    prompt_ids = bpe_ids(KF11_PROMPT)
    want = KF11_STOP if include else ""
    whole = stream([cont], prompt_ids, stop=[KF11_STOP], include_stop_str_in_output=include)
    assert whole[2] == KF11_STOP and whole[3].text == want  # non-streaming
    for groups in groupings(cont):
        deltas, tail, stop, d = stream(groups, prompt_ids, stop=[KF11_STOP], include_stop_str_in_output=include)
        assert stop == KF11_STOP, groups
        # Nothing is emitted past "ABC" before the stop string completes (the last push), then at most the stop.
        assert all(x == "" for x in deltas[:-1]), (groups, deltas)
        assert deltas[-1] == want and tail == ""
        assert "".join(deltas) + tail == d.text == whole[3].text  # streaming equals non-streaming
        # Ids stop at the token that completes the stop string.
        assert d.token_ids == cont[: len(d.token_ids)] and TOK.decode(d.token_ids).endswith("J")


def test_kf11_held_back_text_that_is_not_a_stop_is_flushed():
    prompt_ids = bpe_ids(KF11_PROMPT)
    for cont, want_before_flush in (("DEF", ""), ("DEFGHI", ""), ("DEFX", "DEFX"), ("DEFGHIX", "DEFGHIX")):
        ids = char_ids(cont)
        for groups in groupings(ids):
            deltas, tail, stop, d = stream(groups, prompt_ids, stop=[KF11_STOP])
            assert stop is None
            assert "".join(deltas) == want_before_flush, (cont, groups)
            assert "".join(deltas) + tail == cont == d.text


def test_held_back_suffix_is_released_as_soon_as_it_cannot_start_a_stop():
    d = IncrementalDetokenizer(TOK, [], stop=["abcabd"])
    assert d.push(char_ids("xabcab")) == ("x", None)  # "abcab" might still become "abcabd"
    assert d.push(char_ids("c")) == ("abc", None)  # "abcabc": only "abc" can still start a stop
    assert d.push(char_ids("abd")) == ("", "abcabd")
    assert d.text == "xabc" and d.flush() == ""


@pytest.mark.parametrize(
    ("text", "stops", "include", "want"),
    [
        ("你好吗😀!", ["好"], False, "你"),
        ("你好吗😀!", ["好"], True, "你好"),
        ("你好吗😀!", ["😀"], False, "你好吗"),
        ("你好吗😀!", ["😀"], True, "你好吗😀"),
        ("你好吗😀!", ["吗😀!x", "😀!"], False, "你好吗"),
        ("ab你cd", ["你c"], True, "ab你c"),
    ],
)
def test_a_stop_never_splits_a_multibyte_character(text, stops, include, want):
    for tokenize in (byte_ids, char_ids, bpe_ids):
        ids = tokenize(text)
        for groups in some_groupings(ids, seed=1):
            deltas, tail, stop, d = stream(groups, stop=stops, include_stop_str_in_output=include)
            assert stop is not None
            assert all(FFFD not in x for x in deltas)
            assert "".join(deltas) + tail == want == d.text


def test_stops_completing_in_one_push_pick_the_one_that_ends_first():
    _, _, stop, d = stream([char_ids("xxabcd")], stop=["bcd", "ab"])
    assert stop == "ab" and d.text == "xx"
    _, _, stop, d = stream([char_ids("xxabc")], stop=["bc", "abc"])  # same end: the one starting first
    assert stop == "abc" and d.text == "xx"


def test_after_a_stop_pushes_emit_nothing_and_ids_stop_at_the_completing_token():
    d = IncrementalDetokenizer(TOK, [], stop=["b"])
    ids = char_ids("abcd")
    assert d.push(ids) == ("a", "b")
    assert d.token_ids == ids[:2]
    assert d.push(char_ids("zz")) == ("", "b")
    assert d.finished and d.flush() == "" and d.text == "a"


def test_empty_stop_string_and_push_after_flush_are_errors():
    with pytest.raises(ValueError, match="empty string"):
        IncrementalDetokenizer(TOK, [], stop=["x", ""])
    d = IncrementalDetokenizer(TOK, [])
    d.flush()
    with pytest.raises(RuntimeError, match="after flush"):
        d.push([5])


# --------------------------------------------------------------------------- property: any text, stops, split

_PIECES = ["a", "b", "c", " ", "你", "好", "😀", "é"]


def _reference(text: str, stops: list[str], include: bool) -> str:
    """Non-streaming answer: cut at the stop occurrence that ends first (ties: starts first)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i)
    if best is None:
        return text
    return text[: best[0]] if include else text[: best[1]]


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(st.sampled_from(_PIECES), max_size=14).map("".join),
    stops=st.lists(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=4).map("".join), max_size=3),
    include=st.booleans(),
    tokenize=st.sampled_from([bpe_ids, byte_ids, char_ids]),
    seed=st.integers(0, 2**16),
)
def test_streamed_text_equals_the_non_streamed_answer_for_any_split(text, stops, include, tokenize, seed):
    ids = tokenize(text)
    want = _reference(text, stops, include)
    rng = random.Random(seed)
    groups, i = [], 0
    while i < len(ids):
        j = i + rng.randint(1, 5)
        groups.append(ids[i:j])
        i = j
    deltas, tail, _, d = stream(groups, stop=stops, include_stop_str_in_output=include)
    assert all(FFFD not in x for x in [*deltas, tail])
    assert "".join(deltas) + tail == want == d.text
    # Nothing emitted is ever taken back: every prefix of the stream is a prefix of the answer.
    assert all(want.startswith("".join(deltas[:k])) for k in range(len(deltas) + 1))


# --------------------------------------------------------------------------- a decoder whose text is not monotonic


def _replacing_tokenizer():
    """Word-level ids a=0, b=1, c=2 whose decoder rewrites "ab" as "XYZ": decode([a, b]) does not start with
    decode([a]), so ``DecodeStream`` raises "Invalid prefix encountered" on b after a."""
    from tokenizers import Tokenizer, decoders, models
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "XYZ")])
    return tok


def test_a_non_monotonic_decoder_restarts_the_stream_instead_of_raising():
    from tokenizers.decoders import DecodeStream
    tok = _replacing_tokenizer()
    raw = DecodeStream(ids=[2], skip_special_tokens=True)
    raw.step(tok, 0)
    with pytest.raises(Exception, match="Invalid prefix"):
        raw.step(tok, 1)
    ids = [0, 1, 2, 0, 2, 0]
    for groups in some_groupings(ids, seed=3):
        d = IncrementalDetokenizer(tok, [2])
        deltas = [d.push(g)[0] for g in groups]
        tail = d.flush()
        # "a" was emitted before "b" turned "ab" into "XYZ": the restarted stream decodes b without the a it cannot
        # take back, and the following ids in their new context.
        assert "".join(deltas) + tail == d.text == "abcaca"


# --------------------------------------------------------------------------- text before a split character


def _lead_byte_token(prefix: str) -> int:
    """A token whose bytes are ``prefix`` then the first byte of a multi-byte character (a ByteLevel merge)."""
    for i in range(TOK.get_vocab_size()):
        tok = TOK.id_to_token(i)
        raw = bytes(SYMBOL_BYTE[c] for c in tok) if tok and all(c in SYMBOL_BYTE for c in tok) else b""
        if raw[:-1] == prefix.encode() and raw and raw[-1] >= 0xC2:
            return i
    raise LookupError(prefix)


@pytest.mark.parametrize("stop, include, want_text, want_stop", [
    (None, False, "hi ", None),        # the space before the split character is text, flushed or not
    ([" "], False, "hi", " "),          # a stop in the text before a split character is found on that token
    (["i "], True, "hi ", "i "),
])
def test_text_before_a_split_character_is_released_and_stops_are_found_there(stop, include, want_text, want_stop):
    ids = bpe_ids("hi") + [_lead_byte_token(" ")]
    d = IncrementalDetokenizer(TOK, bpe_ids("Hello"), stop=stop, include_stop_str_in_output=include)
    delta, hit = d.push(ids)
    assert hit == want_stop
    assert delta + d.flush() == want_text == d.text


@pytest.mark.parametrize("prompt, gen, want", [
    (lambda: bpe_ids("The replacement char is \ufffd"), lambda: bpe_ids(" ok, done"), " ok, done"),
    (lambda: byte_ids("Hello 中")[:-1], lambda: byte_ids("Hello 中")[-1:] + bpe_ids(" ok"), " ok"),
    (lambda: byte_ids("ab中")[:-2], lambda: byte_ids("ab中")[-2:] + bpe_ids("x"), "x"),
])
def test_a_prompt_ending_in_a_replacement_or_split_character_never_leaks_into_the_output(prompt, gen, want):
    """The character a prompt's last ids leave split belongs to the prompt; a genuine U+FFFD at its end too."""
    for groups in some_groupings(gen(), seed=5):
        deltas, tail, stop, d = stream(groups, prompt())
        assert "".join(deltas) + tail == want == d.text


def test_a_restart_decodes_the_held_back_ids_again():
    """q decodes to U+FFFD, so the stream holds it back; b after "aq" rewrites "aqb" and the stream raises; the new
    stream decodes the held-back q with b ("\ufffdb": a U+FFFD the decoder makes, not a split character)."""
    from tokenizers import Tokenizer, decoders, models
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "q": 3, "[UNK]": 4}, unk_token="[UNK]"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("q", "\ufffd"), decoders.Replace("\ufffdb", "!"),
                                     decoders.Replace("a!", "ZZZZ")])
    assert tok.decode([2, 0, 3, 1]) == "cZZZZ"
    for groups in some_groupings([0, 3, 1, 2], seed=4):
        d = IncrementalDetokenizer(tok, [2])
        deltas = [d.push(g)[0] for g in groups]
        assert "".join(deltas) + d.flush() == d.text == "a!c"
