"""Tests for v41.models.engram_hash (docs/model.md §3.3, Engram token-id -> row-id hashing)."""

from __future__ import annotations

import pathlib
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v41.engine.byte_level_text import BYTE_SYMBOL
from v41.models import engram_hash as eh

# V4.1-Flash text_config values (spec §1.1)
FLASH = dict(
    engram_layer_ids=[1, 14],
    engram_max_ngram_size=4,
    engram_n_heads=8,
    engram_vocab_size=16_000_000,
    engram_compressed_vocab_size=99092,
    engram_pad_token_id=2,
    engram_num_embeddings=[384006168, 384016682],
)
TINY_TOKENIZER = pathlib.Path(__file__).resolve().parents[1] / "python/v41/testing/data/tokenizer.json"


# --------------------------------------------------------------------------------------------------
# independent slow reference (Python ints, loops)
# --------------------------------------------------------------------------------------------------


def _slow_is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def _slow_primes(layer_ids, max_n, n_heads, vocab):
    """Consecutive primes > vocab - 1, handed out layer by layer, order by order, head by head."""
    out, p = {}, vocab - 1
    for layer in layer_ids:
        cols = []
        for _ in range((max_n - 1) * n_heads):
            p += 1
            while not _slow_is_prime(p):
                p += 1
            cols.append(p)
        out[layer] = cols
    return out


def _slow_multipliers(layer, max_n, cvocab):
    bound = max(1, (2**63 - 1) // cvocab // 2)
    vals = np.random.default_rng(10007 * layer).integers(low=0, high=bound, size=max_n, dtype=np.int64)
    return [2 * int(v) + 1 for v in vals]


def _slow_hash(seq, dead, token_map, pad_token_id, mults, primes, max_n, n_heads):
    """Hash ids of every position of a whole sequence (list of lists of Python ints)."""
    pad = int(token_map[pad_token_id])
    offsets, acc = [], 0
    for p in primes:
        offsets.append(acc)
        acc += p
    rows = []
    for pos in range(len(seq)):
        blocked, vals = False, []
        for s in range(max_n):
            q = pos - s
            if q < 0 or dead[q]:
                blocked = True
            vals.append(pad if blocked else int(token_map[seq[q]]))
        r, row = 0, []
        for s in range(max_n):
            r ^= vals[s] * mults[s]
            assert 0 <= r < 2**63
            if s >= 1:
                for h in range(n_heads):
                    c = (s - 1) * n_heads + h
                    row.append(r % primes[c] + offsets[c])
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def flash_hasher():
    """Flash-shaped hasher over a synthetic 1000-token map covering the full compressed range."""
    rng = np.random.default_rng(0)
    token_map = rng.integers(0, FLASH["engram_compressed_vocab_size"], size=1000, dtype=np.int64)
    token_map[7] = FLASH["engram_compressed_vocab_size"] - 1  # largest compressed id -> largest products
    token_map[8] = 0
    return eh.EngramHasher(
        layer_ids=FLASH["engram_layer_ids"],
        token_map=token_map,
        max_ngram_size=4,
        n_heads=8,
        engram_vocab_size=FLASH["engram_vocab_size"],
        compressed_vocab_size=FLASH["engram_compressed_vocab_size"],
        pad_token_id=FLASH["engram_pad_token_id"],
    )


@pytest.fixture(scope="module")
def slow_tables():
    primes = _slow_primes(FLASH["engram_layer_ids"], 4, 8, FLASH["engram_vocab_size"])
    mults = {l: _slow_multipliers(l, 4, FLASH["engram_compressed_vocab_size"]) for l in FLASH["engram_layer_ids"]}
    return primes, mults


def _slow_for(hasher, slow_tables, layer, seq, dead):
    primes, mults = slow_tables
    return _slow_hash(seq, dead, hasher.token_map, hasher.pad_token_id, mults[layer], primes[layer], 4, 8)


# --------------------------------------------------------------------------------------------------
# primes / table layout
# --------------------------------------------------------------------------------------------------


def test_flash_table_rows_pinned():
    t0 = time.perf_counter()
    rows = eh.engram_table_rows([1, 14], 4, 8, 16_000_000)
    assert time.perf_counter() - t0 < 0.5
    assert rows == [384006168, 384016682]


def test_flash_primes_layout(slow_tables):
    primes = eh.engram_primes([1, 14], 4, 8, 16_000_000)
    assert list(primes) == [1, 14]
    for layer in (1, 14):
        assert primes[layer].dtype == np.int64 and primes[layer].shape == (24,)
        assert primes[layer].tolist() == slow_tables[0][layer]
    allp = np.concatenate([primes[1], primes[14]])
    assert len(set(allp.tolist())) == 48 and np.all(np.diff(allp) > 0)
    assert allp[0] == 16000057  # smallest prime > 15,999,999
    off = eh.engram_offsets(primes[1])
    assert off.dtype == np.int64 and off[0] == 0
    assert np.array_equal(off[1:], np.cumsum(primes[1])[:-1])
    assert int(off[-1] + primes[1][-1]) == 384006168


def test_primes_global_used_set_across_layers():
    # a layer listed first gets the smallest primes, whatever its id
    a = eh.engram_primes([14, 1], 4, 8, 16_000_000)
    b = eh.engram_primes([1, 14], 4, 8, 16_000_000)
    assert a[14].tolist() == b[1].tolist() and a[1].tolist() == b[14].tolist()
    # tiny configuration checked by hand: primes > 9 are 11, 13, 17, 19, 23, 29
    p = eh.engram_primes([3, 5], 3, 1, 10)
    assert p[3].tolist() == [11, 13] and p[5].tolist() == [17, 19]
    assert eh.engram_table_rows([3, 5], 3, 1, 10) == [24, 36]


def test_is_prime():
    small = [n for n in range(2000) if _slow_is_prime(n)]
    assert [n for n in range(2000) if eh.is_prime(n)] == small
    for n in (561, 1105, 1729, 2047, 3215031751, 3825123056546413051, 318665857834031151167461):
        assert not eh.is_prime(n)  # Carmichael numbers / strong pseudoprimes (the last one to all bases 2..37)
    for n in (2**61 - 1, 2**31 - 1, 18446744073709551557, 16000057):
        assert eh.is_prime(n)


# --------------------------------------------------------------------------------------------------
# multipliers
# --------------------------------------------------------------------------------------------------


def test_multipliers_odd_in_range_reproducible():
    cv = 99092
    bound = max(1, (2**63 - 1) // cv // 2)
    for layer in (1, 14):
        m = eh.hash_multipliers(layer, 4, cv)
        assert m.dtype == np.int64 and m.shape == (4,)
        assert np.all(m % 2 == 1) and np.all(m >= 1) and np.all(m < 2 * bound)
        assert np.array_equal(m, eh.hash_multipliers(layer, 4, cv))
        assert m.tolist() == _slow_multipliers(layer, 4, cv)
        assert (cv - 1) * int(m.max()) < 2**63
    assert not np.array_equal(eh.hash_multipliers(1, 4, cv), eh.hash_multipliers(14, 4, cv))
    # the bound depends on the compressed vocab size
    assert not np.array_equal(eh.hash_multipliers(1, 4, cv), eh.hash_multipliers(1, 4, cv + 1))
    # degenerate bound B = 1 -> all multipliers are 1
    assert eh.hash_multipliers(1, 4, 2**63 - 1).tolist() == [1, 1, 1, 1]


# --------------------------------------------------------------------------------------------------
# hashing vs the slow reference
# --------------------------------------------------------------------------------------------------

SEQ = [5, 7, 8, 2, 999, 7, 7, 0, 123, 456, 789, 7, 8, 9]
DEAD = [False] * len(SEQ)
DEAD[6] = True  # an image token in the middle


@pytest.mark.parametrize("layer", [1, 14])
def test_hash_matches_slow_whole_sequence(flash_hasher, slow_tables, layer):
    got = flash_hasher.hash_ids(layer, SEQ, dead=DEAD)
    assert got.dtype == np.int64 and got.shape == (len(SEQ), 24)
    want = _slow_for(flash_hasher, slow_tables, layer, SEQ, DEAD)
    assert got.tolist() == want
    rows = flash_hasher.table_rows[layer]
    assert rows == FLASH["engram_num_embeddings"][FLASH["engram_layer_ids"].index(layer)]
    assert got.min() >= 0 and got.max() < rows
    # each column stays inside its own bucket range
    off, pr = flash_hasher.offsets[layer], flash_hasher.primes[layer]
    assert np.all(got >= off) and np.all(got < off + pr)


def test_hash_padding_and_dead_semantics(flash_hasher):
    h = flash_hasher
    pad_tok = h.pad_token_id
    # position 0 of a sequence == a token preceded by three pad tokens... whose own n-grams differ,
    # but the last row is what counts: hashing [pad, pad, pad, x] gives x's row at sequence start
    x = 123
    at_start = h.hash_ids(1, [x])
    padded = h.hash_ids(1, [pad_tok, pad_tok, pad_tok, x])[-1:]
    assert np.array_equal(at_start, padded)
    # a dead token blocks everything older: after the dead token, rows equal those at sequence start
    a = h.hash_ids(1, [11, 12, 13, 14, 15, 16, 17], dead=[0, 0, 0, 1, 0, 0, 0])
    b = h.hash_ids(1, [15, 16, 17])
    assert np.array_equal(a[4:], b)
    # a dead position itself hashes all-pad slots
    c = h.hash_ids(1, [pad_tok, pad_tok, pad_tok, pad_tok])[-1]
    assert np.array_equal(a[3], c)
    # without the dead flag the rows differ
    assert not np.array_equal(h.hash_ids(1, [11, 12, 13, 14, 15, 16, 17])[4:], b)


@pytest.mark.parametrize("layer", [1, 14])
def test_chunking_with_history_equals_whole(flash_hasher, slow_tables, layer):
    h = flash_hasher
    whole = h.hash_ids(layer, SEQ, dead=DEAD)
    for split in range(len(SEQ) + 1):
        hist, hdead = SEQ[max(0, split - 3) : split], DEAD[max(0, split - 3) : split]
        first = h.hash_ids(layer, SEQ[:split], dead=DEAD[:split])
        second = h.hash_ids(layer, SEQ[split:], history=hist, dead=DEAD[split:], history_dead=hdead)
        assert np.array_equal(np.concatenate([first, second]), whole), split
    # longer history is trimmed to the last max_ngram_size - 1 ids
    long_hist = h.hash_ids(layer, SEQ[8:], history=SEQ[:8], dead=DEAD[8:], history_dead=DEAD[:8])
    assert np.array_equal(long_hist, whole[8:])


def test_chunking_via_next_history(flash_hasher):
    h = flash_hasher
    whole = h.hash_ids_all_layers(SEQ, dead=DEAD)
    assert whole.shape == (len(SEQ), 2, 24)
    hist, hdead, parts = None, None, []
    for lo, hi in [(0, 2), (2, 3), (3, 7), (7, 8), (8, 8), (8, 14)]:
        parts.append(h.hash_ids_all_layers(SEQ[lo:hi], hist, DEAD[lo:hi], hdead))
        hist, hdead = h.next_history(SEQ[lo:hi], hist, DEAD[lo:hi], hdead)
        assert hist.tolist() == SEQ[max(0, hi - 3) : hi] and hdead.tolist() == DEAD[max(0, hi - 3) : hi]
    assert np.array_equal(np.concatenate(parts), whole)


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 999), st.booleans()), min_size=0, max_size=24),
    split=st.integers(0, 24),
    layer=st.sampled_from([1, 14]),
)
def test_hash_property_vs_slow(flash_hasher, slow_tables, data, split, layer):
    seq = [t for t, _ in data]
    dead = [d and (i % 3 == 0) for i, (_, d) in enumerate(data)]  # sparse dead tokens
    want = _slow_for(flash_hasher, slow_tables, layer, seq, dead)
    split = min(split, len(seq))
    a = flash_hasher.hash_ids(layer, seq[:split], dead=dead[:split])
    b = flash_hasher.hash_ids(
        layer, seq[split:], history=seq[:split][-3:], dead=dead[split:], history_dead=dead[:split][-3:]
    )
    got = np.concatenate([a, b])
    assert got.shape == (len(seq), 24)
    assert got.tolist() == want


def test_hash_is_vectorized_fast(flash_hasher):
    toks = np.random.default_rng(1).integers(0, 1000, size=200_000)
    t0 = time.perf_counter()
    out = flash_hasher.hash_ids(14, toks)
    assert out.shape == (200_000, 24)
    assert time.perf_counter() - t0 < 2.0


def test_hash_input_validation(flash_hasher):
    with pytest.raises(ValueError):
        flash_hasher.hash_ids(1, [1000])
    with pytest.raises(ValueError):
        flash_hasher.hash_ids(1, [-1])
    with pytest.raises(ValueError):
        flash_hasher.hash_ids(1, [1, 2], dead=[True])
    with pytest.raises(KeyError):
        flash_hasher.hash_ids(2, [1, 2])
    assert flash_hasher.hash_ids(1, []).shape == (0, 24)


# --------------------------------------------------------------------------------------------------
# compressed token map
# --------------------------------------------------------------------------------------------------


def _bl(text_or_bytes) -> str:
    data = text_or_bytes.encode("utf-8") if isinstance(text_or_bytes, str) else text_or_bytes
    return "".join(BYTE_SYMBOL[b] for b in data)


# (decoded text or raw bytes, expected compressed id)
TINY_TOKENS = [
    ("<s>", 0),  # special tokens (ids 0..2), kept by decode(skip_special_tokens=False)
    ("</s>", 1),
    ("<pad>", 2),
    ("Hello", 3),
    (" hello", 3),  # leading space stripped
    ("HÉLLO", 3),  # accent + case
    ("\t", 4),  # collapses to one space, protected from Strip
    ("  ", 4),
    (" ", 4),
    ("\r\n", 4),
    ("\u00a0", 4),  # NBSP -> NFKC -> " "
    ("\u3000", 4),  # ideographic space -> " "
    (" \t x", 5),  # -> " x" -> "x"
    ("X", 5),
    ("\u0301", 6),  # lone combining acute: normalizes to "" -> falls back to the raw text
    ("\u0300", 7),  # a different lone mark -> a different raw text -> its own id
    ("ﬁ", 8),  # NFKC ligature -> "fi"
    ("FI", 8),
    (b"\xe2", 9),  # partial UTF-8 -> decodes to U+FFFD -> keyed by its raw token string
    (b"\xe2\x80", 10),  # a different partial token keeps its own id
    ("का", 11),  # Devanagari vowel sign (category Mc) is dropped by tokenizers' StripAccents
    ("क", 11),
    ("ΣΑΣ", 12),  # Rust lowercase: no final-sigma rule -> "σασ"
    ("σασ", 12),
    ("Café", 13),
    ("cafe", 13),
    ("\x1c", 14),  # not White_Space for Rust's Strip -> kept
    (" \x1c", 14),
]


def _build_tiny_tokenizer():
    """Byte-level BPE (no merges) whose token i decodes to TINY_TOKENS[i][0]."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    for text, _ in TINY_TOKENS[3:]:
        tok = _bl(text)
        assert tok not in vocab
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<pad>")])
    return tk


def test_tiny_token_map_collapses_variants():
    tk = _build_tiny_tokenizer()
    n = tk.get_vocab_size(with_added_tokens=True)
    assert n == len(TINY_TOKENS)
    assert [tk.decode([i], skip_special_tokens=False) for i in range(14)] == [t for t, _ in TINY_TOKENS[:14]]
    tmap = eh.build_compressed_token_map(tk)
    assert tmap.dtype == np.int64 and tmap.shape == (n,)
    assert tmap.tolist() == [cid for _, cid in TINY_TOKENS]
    assert eh.compressed_vocab_size(tk) == 15 == eh.compressed_vocab_size(tmap)
    # the partial-UTF-8 tokens really do decode to U+FFFD
    assert "\ufffd" in tk.decode([tk.token_to_id(_bl(b"\xe2"))], skip_special_tokens=False)


def test_normalizer_chain():
    n = eh.normalize_token_text
    assert n(" Hello ") == "hello"
    assert n(" ") == " " and n("\t\n") == " " and n("   ") == " "
    assert n(" a \t\r\n b ") == "a b"
    assert n("\u0301") == ""
    assert n("Ǆ") == "dz"  # NFKC "DŽ" -> NFD, caron stripped -> lowercase


def _check_first_appearance(tmap: np.ndarray):
    assert tmap[0] == 0
    running_max = np.maximum.accumulate(tmap)
    # every id is either an old one or exactly one more than the largest so far
    assert np.all(tmap[1:] <= running_max[:-1] + 1)
    assert len(np.unique(tmap)) == int(tmap.max()) + 1


def test_tiny_token_map_first_appearance_order():
    tk = _build_tiny_tokenizer()
    _check_first_appearance(eh.build_compressed_token_map(tk))


@pytest.mark.skipif(not TINY_TOKENIZER.exists(), reason="python/v41/testing/data/tokenizer.json not present")
def test_repo_tiny_tokenizer_token_map():
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(TINY_TOKENIZER))
    tmap = eh.build_compressed_token_map(tk)
    n = tk.get_vocab_size(with_added_tokens=True)
    assert tmap.shape == (n,) and tmap.dtype == np.int64
    _check_first_appearance(tmap)
    # ids sharing a compressed id share a key, and vice versa
    keys = []
    for i in range(n):
        text = tk.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            keys.append(tk.id_to_token(i))
        else:
            norm = eh.normalize_token_text(text)
            keys.append(norm if norm else text)
    first: dict = {}
    for i, k in enumerate(keys):
        first.setdefault(k, tmap[i])
        assert tmap[i] == first[k]
    assert len(first) == eh.compressed_vocab_size(tmap)


# --------------------------------------------------------------------------------------------------
# from_config
# --------------------------------------------------------------------------------------------------


def test_from_config():
    tk = _build_tiny_tokenizer()
    cfg = dict(FLASH, engram_compressed_vocab_size=15)
    h = eh.EngramHasher.from_config(cfg, tk)
    assert h.layer_ids == (1, 14) and h.n_cols == 24 and h.compressed_vocab_size == 15
    assert h.pad == 2  # token_map[engram_pad_token_id = 2]
    assert [h.table_rows[l] for l in (1, 14)] == [384006168, 384016682]
    assert np.array_equal(h.multipliers[14], eh.hash_multipliers(14, 4, 15))
    # nested {"text_config": {...}} and the reference alias engram_pad_id
    cfg2 = {k: v for k, v in cfg.items() if k != "engram_pad_token_id"}
    cfg2["engram_pad_id"] = 2
    h2 = eh.EngramHasher.from_config({"text_config": cfg2}, tk)
    assert np.array_equal(h2.hash_ids(14, [3, 4, 5, 6]), h.hash_ids(14, [3, 4, 5, 6]))

    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        eh.EngramHasher.from_config(FLASH, tk)  # 99092 != 15
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        eh.EngramHasher.from_config(dict(cfg, engram_num_embeddings=[1, 2]), tk)


@pytest.mark.parametrize("layer", [1, 14])
def test_hash_runs_of_a_step_equal_each_request_hashed_alone(flash_hasher, layer):
    """The engine hashes every request of a step in one call; each run keeps its own history and start."""
    rng = np.random.default_rng(5)
    runs = [(rng.integers(0, 1000, n), tuple(rng.integers(0, 1000, h)))
            for n, h in [(1, 3), (9, 0), (4, 2), (1, 1), (17, 3), (1, 0)]]
    got = flash_hasher.hash_runs(layer, runs)
    want = np.concatenate([flash_hasher.hash_ids(layer, t, history=list(h)) for t, h in runs])
    assert got.shape == (sum(len(t) for t, _ in runs), flash_hasher.n_cols)
    assert np.array_equal(got, want)
    assert flash_hasher.hash_runs(layer, []).shape == (0, flash_hasher.n_cols)
