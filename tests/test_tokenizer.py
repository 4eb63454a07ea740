"""Tests for the tiny tokenizer shipped in ``v41/testing/data`` (built by ``v41.testing.build_tokenizer``).

Marker strings and ids follow docs/model.md §7.2: BOS/EOS/pad are ids 0/1/2 as in the real model, the
other markers sit at the end of the 1024-entry vocabulary.
"""

from __future__ import annotations

import hashlib

import pytest
from tokenizers import pre_tokenizers

from v41.testing import build_tokenizer as bt
from v41.testing.tokenizer_files import (
    TOKENIZER_DIR,
    TOKENIZER_SHA256,
    load_tiny_tokenizer,
    tokenizer_path,
)

ROUND_TRIP_TEXTS = [
    "",
    "hi",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\treturn x ** 2  # square\n",
    '{"role": "user", "content": "2 + 2 = 4", "n": [1, 2.5, -3e-4, null]}',
    "今天天气很好，我们去公园散步吧。",
    "Crème brûlée, Müller, mañana, Łódź, naïve façade",
    "emoji 😀🚀👨‍👩‍👧‍👦 🇯🇵 ❤️ flags and ZWJ sequences",
    "  leading spaces, trailing spaces   \n\n\n\ttabs\t\tand\r\nCRLF\r\n",
    "Never seen: \u0000\u0001\u007f \u00ad \u200b \ufeff \U0010ffff ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<｜User｜>hello<｜Assistant｜><think>x</think>done<｜end▁of▁sentence｜>",
    "<|User|> ascii lookalikes <|place_holder_mm_span_0436|> ｜ ▁",
]


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


def test_shipped_tokenizer_json_matches_pinned_sha256():
    assert hashlib.sha256(tokenizer_path().read_bytes()).hexdigest() == TOKENIZER_SHA256


def test_rebuild_gives_identical_bytes():
    assert bt.tokenizer_json(bt.build_tokenizer()) == tokenizer_path().read_bytes()
    assert bt.tokenizer_config_json() == (TOKENIZER_DIR / "tokenizer_config.json").read_bytes()


def test_vocab_layout_and_markers_are_single_tokens(tok):
    assert tok.get_vocab_size(with_added_tokens=True) == bt.VOCAB_SIZE == 1024
    assert [tok.token_to_id(t) for t in (bt.BOS_TOKEN, bt.EOS_TOKEN, bt.PAD_TOKEN)] == [0, 1, 2]
    assert bt.BOS_TOKEN == "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    assert bt.PAD_TOKEN == "<\uff5c\u2581pad\u2581\uff5c>"
    tail_ids = [tok.token_to_id(t) for t in bt.TAIL_SPECIAL_TOKENS]
    assert tail_ids == list(range(1024 - len(bt.TAIL_SPECIAL_TOKENS), 1024))
    added = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    assert set(added) == set(bt.SPECIAL_TOKENS)
    for marker in bt.SPECIAL_TOKENS:
        assert added[marker].special and not added[marker].normalized
        ids = tok.encode(marker, add_special_tokens=False).ids
        assert ids == [tok.token_to_id(marker)], marker
        assert tok.decode(ids, skip_special_tokens=False) == marker


def test_all_bytes_are_in_the_base_alphabet(tok):
    vocab = tok.get_vocab(with_added_tokens=False)
    for ch in pre_tokenizers.ByteLevel.alphabet():
        assert ch in vocab
    assert sorted(vocab[ch] for ch in pre_tokenizers.ByteLevel.alphabet()) == list(range(3, 259))


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip_is_exact(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_add_special_tokens_does_not_insert_bos_or_eos(tok):
    assert tok.encode("hi", add_special_tokens=True).ids == tok.encode("hi", add_special_tokens=False).ids
    assert 0 not in tok.encode("hi").ids and 1 not in tok.encode("hi").ids


def test_marker_matching_in_typed_text(tok):
    """Pin how markers inside ordinary text are split.

    ``encode(text, add_special_tokens=False)`` only turns off post-processor insertions; added tokens are
    still matched anywhere in the text (what vLLM relies on for rendered prompts, §7.2). ASCII lookalikes
    are plain text. ``encode_special_tokens = True`` turns matching off, so a typed marker becomes bytes.
    """
    enc = tok.encode("a<｜User｜>b<think>c</think>", add_special_tokens=False)
    assert enc.tokens == ["a", "<｜User｜>", "b", "<think>", "c", "</think>"]
    assert enc.ids == [67, 1009, 68, 1011, 69, 1012]

    # The DSML marker is one token; the "<", tag name and ">" around it are ordinary text.
    enc = tok.encode("<｜DSML｜tool_calls>", add_special_tokens=False)
    assert enc.ids[:3] == [30, 1013, 283] and enc.ids[-1] == 32
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<｜DSML｜tool_calls>"

    # Markers match without surrounding spaces being absorbed (lstrip/rstrip off).
    assert tok.encode(" <think> ", add_special_tokens=False).tokens == ["Ġ", "<think>", "Ġ"]

    # ASCII lookalike: several plain tokens, no special id.
    lookalike = tok.encode("<|User|>", add_special_tokens=False)
    assert lookalike.tokens == ["<", "|", "U", "ser", "|", ">"]
    assert all(2 < i < 1008 for i in lookalike.ids)

    # With matching off, the typed marker is plain bytes and still round-trips.
    tok2 = load_tiny_tokenizer()
    tok2.encode_special_tokens = True
    ids = tok2.encode("<｜User｜>hi", add_special_tokens=False).ids
    assert not set(ids) & {tok.token_to_id(t) for t in bt.SPECIAL_TOKENS}
    assert tok2.decode(ids) == "<｜User｜>hi"

    # decode drops special tokens only when asked.
    assert tok.decode([0, 1009, 74, 75, 1], skip_special_tokens=True) == "hi"


def test_transformers_loads_offline_and_agrees(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path()))
    auto = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    assert len(fast) == len(auto) == 1024
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    for text in ROUND_TRIP_TEXTS:
        want = tok.encode(text, add_special_tokens=False).ids
        assert fast.encode(text, add_special_tokens=False) == want
        assert auto.encode(text, add_special_tokens=False) == want
        assert auto.encode(text) == want  # add_bos_token false: no BOS
        assert auto.decode(want) == tok.decode(want, skip_special_tokens=False)
