"""The native step hasher (crate v41-engram, ``v41._native.EngramHasher``) against the Python oracle
``v41.models.engram_hash.EngramHasher`` (docs/model.md §3.3): Flash parameters over a synthetic token map, and the
embedded tiny model's real tokenizer map; dead tokens, histories shorter than the lookback, several requests per
step, bad ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from v41 import _native
from v41.config import load_config
from v41.engine.engram_rows import StepRowHasher
from v41.models import engram_hash as eh
from v41.models.engram_loader import engram_hasher

EMBEDDED = Path(__file__).resolve().parents[1] / "python" / "v41" / "embedded"
FLASH = dict(layer_ids=[1, 14], max_ngram_size=4, n_heads=8, engram_vocab_size=16_000_000,
             compressed_vocab_size=99092, pad_token_id=2)


@pytest.fixture(scope="module")
def flash():
    rng = np.random.default_rng(1)
    token_map = rng.integers(0, 99092, size=3000, dtype=np.int64)
    token_map[7], token_map[8] = 99091, 0  # the largest products
    return eh.EngramHasher(token_map=token_map, **FLASH)


@pytest.fixture(scope="module")
def tiny():
    return engram_hasher(load_config(EMBEDDED), EMBEDDED / "tokenizer.json")


def _oracle(h: eh.EngramHasher, runs) -> dict[int, np.ndarray]:
    return {lid: np.concatenate([h.hash_ids(lid, t, history=hist, dead=d, history_dead=hd)
                                 for t, hist, d, hd in runs]) for lid in h.layer_ids}


@pytest.mark.parametrize("which", ["flash", "tiny"])
@pytest.mark.parametrize("seed", range(4))
def test_native_step_equals_the_python_hasher(which, seed, request):
    h = request.getfixturevalue(which)
    rng = np.random.default_rng(seed)
    native = StepRowHasher(h)
    vocab = h.token_map.size
    runs, flat, counts, hist_native, dead_all = [], [], [], [], []
    for _ in range(rng.integers(1, 9)):
        n = int(rng.integers(0, 20))
        toks = rng.integers(0, vocab, size=n)
        hist = rng.integers(0, vocab, size=int(rng.integers(0, 4)))
        dead = rng.random(n) < 0.1
        hdead = rng.random(hist.size) < 0.2
        runs.append((toks, hist, dead, hdead))
        flat += toks.tolist()
        counts.append(n)
        row = np.full(3, -1, dtype=np.int64)
        if hist.size:
            row[3 - hist.size:] = np.where(hdead, -2, hist)
        hist_native.append(row)
        dead_all += dead.tolist()
    got = native.native.hash_step(np.array(flat, dtype=np.int64), np.array(counts, dtype=np.int64),
                                  np.concatenate(hist_native), np.array(dead_all, dtype=bool))
    want = _oracle(h, runs)
    for i, lid in enumerate(h.layer_ids):
        np.testing.assert_array_equal(got[i], want[lid])


def test_step_row_hasher_matches_hash_runs(tiny):
    native = StepRowHasher(tiny)
    runs = [([5, 6, 7], [1, 2]), ([9], []), ([], [3, 4, 5]), ([10, 11], [1, 2, 3, 4, 5])]
    got = native.rows(np.array([5, 6, 7, 9, 10, 11]), np.array([3, 1, 0, 2]), [h for _, h in runs])
    for lid in tiny.layer_ids:
        np.testing.assert_array_equal(got[lid], tiny.hash_runs(lid, runs))


def test_native_primes_and_rows_match(flash):
    native = StepRowHasher(flash).native
    assert [native.table_rows(i) for i in range(2)] == [384006168, 384016682]
    assert native.columns == 24 and native.layer_ids == [1, 14]


def test_bad_inputs_are_value_errors(flash):
    native = StepRowHasher(flash).native
    one = np.array([1], dtype=np.int64)
    with pytest.raises(ValueError, match="outside the Engram token map"):
        native.hash_step(np.array([3000], dtype=np.int64), one, np.full(3, -1, dtype=np.int64))
    with pytest.raises(ValueError, match="history needs 3 entries"):
        native.hash_step(one, one, np.full(2, -1, dtype=np.int64))
    with pytest.raises(ValueError, match="sum to"):
        native.hash_step(one, np.array([2], dtype=np.int64), np.full(3, -1, dtype=np.int64))
    with pytest.raises(ValueError, match="max_ngram_size must be >= 2"):
        _native.EngramHasher(np.zeros(4, dtype=np.int64), 1, 0, 1, 1, 5, [(1, [1])])
