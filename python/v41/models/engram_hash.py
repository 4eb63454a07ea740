"""Engram n-gram hashing: token ids -> Engram table row ids (docs/model.md §3.3).

This module covers only the integer part of Engram (spec §3.3 "Compressed token map", "Hash
multipliers", "Prime buckets", "Hash ids per token"); the table lookup and the neural gate live
elsewhere. Everything here is NumPy / pure Python and runs on the host.

Pipeline for one Engram layer ``l`` and one request:

1. ``token_map`` (``int64 [len(tokenizer)]``) folds token ids that normalize alike ("The", " the",
   "THE") onto one compressed id (:func:`build_compressed_token_map`).
2. Position ``p`` looks back at tokens ``p-0 .. p-(max_ngram_size-1)``; ``v_s = token_map[token]``,
   except that once a lookback runs before the sequence start or hits a dead (image) token, that slot
   and every older one hold ``pad = token_map[pad_token_id]``.
3. ``R_s = XOR_{k<=s} (v_k * m_k)`` with odd per-layer multipliers ``m`` (:func:`hash_multipliers`).
4. For n-gram order ``n = s+1 >= 2`` and head ``h`` the column is ``c = (n-2)*n_heads + h`` and the
   row id in the layer's table is ``(R_s mod prime_c) + offset_c`` (:func:`engram_primes`,
   :func:`engram_offsets`).

Behaviour follows the vendored official reference ``inference/engram.py`` of DeepSeek-V4.1-Flash
(``build_compressed_token_map``, ``compute_hash_multipliers``, ``EngramLayout``, ``NgramHashState``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "build_compressed_token_map",
    "compressed_vocab_size",
    "hash_multipliers",
    "is_prime",
    "engram_primes",
    "engram_table_rows",
    "engram_offsets",
    "EngramHasher",
]

_INT64_MAX = int(np.iinfo(np.int64).max)


# --------------------------------------------------------------------------------------------------
# Compressed token map (§3.3 "Compressed token map")
# --------------------------------------------------------------------------------------------------

_SENTINEL = "\ue000"  # private-use char protecting a text that is exactly one space from Strip()
_NORMALIZER = None


def _normalizer():
    """The §3.3 normalizer chain, built with HF ``tokenizers`` normalizers exactly as the reference.

    NFKC -> NFD -> StripAccents -> Lowercase -> ``[ \\t\\r\\n]+`` -> " " -> (``^ $`` -> sentinel) ->
    Strip -> (sentinel -> " "). The Rust implementations are used on purpose rather than
    ``unicodedata``/``str`` methods, because they differ on real vocabularies: ``StripAccents`` drops
    every combining mark (general category Mn, Mc *and* Me, e.g. Devanagari vowel signs), ``Lowercase``
    has no Greek final-sigma rule, and ``Strip`` uses Rust's ``White_Space`` (not e.g. U+001C..U+001F).
    """
    global _NORMALIZER
    if _NORMALIZER is None:
        from tokenizers import Regex, normalizers

        _NORMALIZER = normalizers.Sequence(
            [
                normalizers.NFKC(),
                normalizers.NFD(),
                normalizers.StripAccents(),
                normalizers.Lowercase(),
                normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
                normalizers.Replace(Regex(r"^ $"), _SENTINEL),
                normalizers.Strip(),
                normalizers.Replace(_SENTINEL, " "),
            ]
        )
    return _NORMALIZER


def _backend_and_len(tokenizer) -> tuple[Any, int]:
    """(raw ``tokenizers.Tokenizer``, number of ids) for a raw tokenizer or an HF fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # transformers PreTrainedTokenizerFast: len() counts added tokens
        return backend, len(tokenizer)
    return tokenizer, int(tokenizer.get_vocab_size(with_added_tokens=True))


def normalize_token_text(text: str) -> str:
    """Apply the §3.3 normalizer chain to one decoded token text (no U+FFFD / empty fallback)."""
    return _normalizer().normalize_str(text)


def build_compressed_token_map(tokenizer) -> np.ndarray:
    """Map every token id onto the compressed id space of spec §3.3.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (or a transformers fast tokenizer; its
            ``backend_tokenizer`` is used and ``len(tokenizer)`` ids are mapped).

    Returns:
        ``np.ndarray`` of dtype ``int64`` and shape ``[len(tokenizer)]``; entry ``i`` is the
        compressed id of token ``i``. Compressed ids are assigned in order of first appearance of
        their key, so ``map[0] == 0`` and ``int(map.max()) + 1`` is the compressed vocab size
        (99092 for V4.1-Flash).

    Key of token ``i``: decode ``[i]`` raw (``skip_special_tokens=False``, no clean-up). If the text
    contains U+FFFD (partial UTF-8 byte token) the key is the raw token string ``id_to_token(i)``;
    otherwise it is the normalized text (see :func:`_normalizer`), falling back to the raw decoded text
    when normalization leaves nothing.
    """
    backend, n = _backend_and_len(tokenizer)
    norm = _normalizer()
    key_to_new: dict[Any, int] = {}
    out = np.empty(n, dtype=np.int64)
    for tid in range(n):
        text = backend.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key: Any = backend.id_to_token(tid)
        else:
            normalized = norm.normalize_str(text)
            key = normalized if normalized else text
        new_id = key_to_new.get(key)
        if new_id is None:
            new_id = len(key_to_new)
            key_to_new[key] = new_id
        out[tid] = new_id
    return out


def compressed_vocab_size(tokenizer_or_map) -> int:
    """Number of distinct compressed ids (spec §1.1 ``engram_compressed_vocab_size``).

    Accepts a tokenizer (the map is built) or an already built ``int64`` map.
    """
    if isinstance(tokenizer_or_map, np.ndarray):
        token_map = tokenizer_or_map
    else:
        token_map = build_compressed_token_map(tokenizer_or_map)
    return int(token_map.max()) + 1 if token_map.size else 0


# --------------------------------------------------------------------------------------------------
# Hash multipliers (§3.3 "Hash multipliers")
# --------------------------------------------------------------------------------------------------


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd per-layer hash multipliers, spec §3.3.

    ``B = max(1, (2**63 - 1) // compressed_vocab_size // 2)``; ``v = default_rng(10007 * layer_id)
    .integers(0, B, size=max_ngram_size, dtype=int64)``; multiplier ``m_s = 2 * v_s + 1``.

    Returns:
        ``np.ndarray`` ``int64 [max_ngram_size]``, every entry odd and ``< 2 * B``, so that
        ``v * m_s`` cannot overflow int64 for any compressed id ``v < compressed_vocab_size``.
    """
    if compressed_vocab_size < 1:
        raise ValueError(f"compressed_vocab_size must be >= 1, got {compressed_vocab_size}")
    bound = max(1, (_INT64_MAX // int(compressed_vocab_size)) // 2)
    rng = np.random.default_rng(10007 * int(layer_id))
    values = rng.integers(low=0, high=bound, size=(int(max_ngram_size),), dtype=np.int64)
    return values * 2 + 1


# --------------------------------------------------------------------------------------------------
# Prime buckets (§3.3 "Prime buckets")
# --------------------------------------------------------------------------------------------------

_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin with the 13 prime bases 2..41: exact for every ``n < 3.3e24``
    (3,317,044,064,679,887,385,961,981), so for all 64-bit integers."""
    n = int(n)
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _SMALL_PRIMES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_unused_prime(start: int, used: set[int]) -> int:
    """Smallest prime ``> start`` that is not in ``used``."""
    candidate = start + 1
    while candidate in used or not is_prime(candidate):
        candidate += 1
    return candidate


def engram_primes(
    engram_layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, engram_vocab_size: int
) -> dict[int, np.ndarray]:
    """Prime bucket sizes per Engram layer, spec §3.3.

    A global used-prime set spans all layers. For each layer (in the given order), for each n-gram
    order ``n = 2..max_ngram_size`` the search restarts at ``engram_vocab_size - 1`` and, for each of
    the ``n_heads`` heads, takes the smallest prime above the previous head's prime (the first head:
    above ``engram_vocab_size - 1``) that has not been used yet. Because of the global set this is the
    run of consecutive primes above ``engram_vocab_size - 1``.

    Returns:
        ``{layer_id: np.ndarray int64 [(max_ngram_size - 1) * n_heads]}``, column ``c =
        (n - 2) * n_heads + h`` (order-major, head-minor).
    """
    used: set[int] = set()
    out: dict[int, np.ndarray] = {}
    for layer_id in engram_layer_ids:
        cols: list[int] = []
        for _n in range(2, int(max_ngram_size) + 1):
            current = int(engram_vocab_size) - 1
            for _h in range(int(n_heads)):
                current = _next_unused_prime(current, used)
                used.add(current)
                cols.append(current)
        if int(layer_id) in out:
            raise ValueError(f"duplicate engram layer id {layer_id}")
        out[int(layer_id)] = np.asarray(cols, dtype=np.int64)
    return out


def engram_table_rows(
    engram_layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, engram_vocab_size: int
) -> list[int]:
    """Table rows per Engram layer (= sum of its primes), in ``engram_layer_ids`` order.

    V4.1-Flash (layers [1, 14], 4, 8, 16_000_000) gives ``[384006168, 384016682]`` (§1.1
    ``engram_num_embeddings``).
    """
    primes = engram_primes(engram_layer_ids, max_ngram_size, n_heads, engram_vocab_size)
    return [int(sum(int(p) for p in primes[int(layer)])) for layer in engram_layer_ids]


def engram_offsets(primes: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums of one layer's primes: ``int64 [n_cols]``, ``offsets[0] == 0``.

    Column ``c`` owns rows ``offsets[c] .. offsets[c] + primes[c] - 1`` of that layer's table.
    """
    primes = np.asarray(primes, dtype=np.int64)
    out = np.zeros_like(primes)
    if primes.size > 1:
        out[1:] = np.cumsum(primes[:-1])
    return out


# --------------------------------------------------------------------------------------------------
# Hash ids per token (§3.3 "Hash ids per token")
# --------------------------------------------------------------------------------------------------


class EngramHasher:
    """Token ids of one request -> Engram row ids for each Engram layer (spec §3.3).

    Attributes (all NumPy ``int64``):
        token_map: ``[vocab]`` compressed id per token id.
        pad: ``token_map[pad_token_id]``, the value of missing / blocked lookback slots.
        multipliers[layer]: ``[max_ngram_size]`` odd multipliers.
        primes[layer], offsets[layer]: ``[n_cols]`` with ``n_cols = (max_ngram_size - 1) * n_heads``.
        table_rows[layer]: ``int`` rows of that layer's table (``sum(primes[layer])``).
    """

    def __init__(
        self,
        layer_ids: Sequence[int],
        token_map: np.ndarray,
        max_ngram_size: int,
        n_heads: int,
        engram_vocab_size: int,
        compressed_vocab_size: int,
        pad_token_id: int,
    ):
        if max_ngram_size < 2:
            raise ValueError(f"max_ngram_size must be >= 2, got {max_ngram_size}")
        self.layer_ids = tuple(int(x) for x in layer_ids)
        self.max_ngram_size = int(max_ngram_size)
        self.n_heads = int(n_heads)
        self.n_cols = (self.max_ngram_size - 1) * self.n_heads
        self.engram_vocab_size = int(engram_vocab_size)
        self.compressed_vocab_size = int(compressed_vocab_size)

        token_map = np.ascontiguousarray(np.asarray(token_map, dtype=np.int64))
        if token_map.ndim != 1 or token_map.size == 0:
            raise ValueError("token_map must be a non-empty 1-D array")
        if int(token_map.min()) < 0 or int(token_map.max()) >= self.compressed_vocab_size:
            raise ValueError(
                f"token_map values must lie in [0, engram_compressed_vocab_size={self.compressed_vocab_size})"
            )
        self.token_map = token_map
        if not 0 <= int(pad_token_id) < token_map.size:
            raise ValueError(f"pad_token_id {pad_token_id} out of range for a {token_map.size}-token map")
        self.pad_token_id = int(pad_token_id)
        self.pad = int(token_map[self.pad_token_id])

        self.primes = engram_primes(self.layer_ids, self.max_ngram_size, self.n_heads, self.engram_vocab_size)
        self.offsets = {layer: engram_offsets(p) for layer, p in self.primes.items()}
        self.table_rows = {layer: int(sum(int(x) for x in p)) for layer, p in self.primes.items()}
        self.multipliers = {
            layer: hash_multipliers(layer, self.max_ngram_size, self.compressed_vocab_size)
            for layer in self.layer_ids
        }
        # No-overflow guarantee: every product v * m fits int64 (Python ints, exact), hence every
        # XOR of such non-negative products too; offsets + (R mod p) < table rows fit as well.
        max_v = int(token_map.max())
        for layer, m in self.multipliers.items():
            assert max_v * int(m.max()) <= _INT64_MAX, (layer, max_v, int(m.max()))
            assert self.table_rows[layer] <= _INT64_MAX

    # ------------------------------------------------------------------ construction from config
    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], tokenizer) -> "EngramHasher":
        """Build from a plain config dict (the ``text_config`` level, or a top-level dict holding one).

        Reads ``engram_layer_ids``, ``engram_max_ngram_size``, ``engram_n_heads``, ``engram_vocab_size``,
        ``engram_compressed_vocab_size``, ``engram_pad_token_id`` (reference alias ``engram_pad_id``).
        ``tokenizer`` is a ``tokenizers.Tokenizer`` (or a prebuilt ``int64`` token map).

        Raises:
            ValueError: naming ``engram_compressed_vocab_size`` if the tokenizer's compressed vocab size
                differs from the config (every multiplier derives from it), or naming
                ``engram_num_embeddings`` if that key is present and disagrees with the prime rule.
        """
        if "engram_layer_ids" not in cfg and isinstance(cfg.get("text_config"), Mapping):
            cfg = cfg["text_config"]
        pad_key = "engram_pad_token_id" if "engram_pad_token_id" in cfg else "engram_pad_id"
        token_map = (
            np.asarray(tokenizer, dtype=np.int64)
            if isinstance(tokenizer, np.ndarray)
            else build_compressed_token_map(tokenizer)
        )
        got = compressed_vocab_size(token_map)
        want = int(cfg["engram_compressed_vocab_size"])
        if got != want:
            raise ValueError(
                f"engram_compressed_vocab_size mismatch: config says {want}, the tokenizer's "
                f"compressed token map has {got} distinct keys"
            )
        hasher = cls(
            layer_ids=list(cfg["engram_layer_ids"]),
            token_map=token_map,
            max_ngram_size=int(cfg["engram_max_ngram_size"]),
            n_heads=int(cfg["engram_n_heads"]),
            engram_vocab_size=int(cfg["engram_vocab_size"]),
            compressed_vocab_size=want,
            pad_token_id=int(cfg[pad_key]),
        )
        if "engram_num_embeddings" in cfg:
            rows = [hasher.table_rows[layer] for layer in hasher.layer_ids]
            if [int(x) for x in cfg["engram_num_embeddings"]] != rows:
                raise ValueError(
                    f"engram_num_embeddings {list(cfg['engram_num_embeddings'])} does not match the "
                    f"prime bucket rule ({rows})"
                )
        return hasher

    # ------------------------------------------------------------------ hashing
    def _compress(self, ids: np.ndarray, what: str) -> np.ndarray:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.token_map.size):
            raise ValueError(f"{what} contains token ids outside [0, {self.token_map.size})")
        return self.token_map[ids]

    def hash_ids(
        self,
        layer_id: int,
        token_ids,
        history=None,
        dead=None,
        history_dead=None,
    ) -> np.ndarray:
        """Row ids into layer ``layer_id``'s Engram table for one request's new tokens (spec §3.3).

        Args:
            layer_id: an Engram layer id (one of ``self.layer_ids``).
            token_ids: integer ``[T]`` new token ids of ONE request.
            history: optional integer ``[H]`` (``H <= max_ngram_size - 1``; longer is trimmed to the last
                ``max_ngram_size - 1``) committed token ids immediately before ``token_ids``, oldest first.
                Shorter than ``max_ngram_size - 1`` means the sequence starts right before it.
            dead: optional bool ``[T]``, True for dead (image) tokens: a dead token and everything before
                it is excluded from the n-grams of later positions; a dead position itself hashes pads.
            history_dead: optional bool ``[H]`` dead flags for ``history`` (default: none dead).

        Returns:
            ``np.ndarray`` ``int64 [T, (max_ngram_size - 1) * n_heads]``; column ``c = (n-2)*n_heads + h``
            holds ``(R_{n-1} mod primes[c]) + offsets[c]``, a row in ``[0, table_rows[layer_id])``.
        """
        layer_id = int(layer_id)
        if layer_id not in self.primes:
            raise KeyError(f"layer {layer_id} has no Engram module (engram layers: {self.layer_ids})")
        tok = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        T = tok.shape[0]
        hist = np.zeros(0, dtype=np.int64) if history is None else np.asarray(history, dtype=np.int64).reshape(-1)
        hdead = (
            np.zeros(hist.shape[0], dtype=bool)
            if history_dead is None
            else np.asarray(history_dead, dtype=bool).reshape(-1)
        )
        if hdead.shape != hist.shape:
            raise ValueError(f"history_dead shape {hdead.shape} != history shape {hist.shape}")
        keep = self.max_ngram_size - 1
        if hist.shape[0] > keep:
            hist, hdead = hist[hist.shape[0] - keep :], hdead[hdead.shape[0] - keep :]
        d = np.zeros(T, dtype=bool) if dead is None else np.asarray(dead, dtype=bool).reshape(-1)
        if d.shape != (T,):
            raise ValueError(f"dead shape {d.shape} != token_ids shape {(T,)}")

        # extended sequence: history then the chunk; chunk position t sits at index H + t
        H = hist.shape[0]
        vals = np.concatenate([self._compress(hist, "history"), self._compress(tok, "token_ids")])
        dead_ext = np.concatenate([hdead, d])
        return self._hash(layer_id, vals, dead_ext, np.arange(T, dtype=np.int64) + H, np.zeros(T, dtype=np.int64))

    def hash_runs(self, layer_id: int, runs) -> np.ndarray:
        """:meth:`hash_ids` of several requests' runs at once: ``runs`` = (token ids [T_r], history ≤ 3 committed
        ids before them) per request, no dead tokens. Returns ``int64 [Σ T_r, n_cols]`` in run order."""
        layer_id = int(layer_id)
        if layer_id not in self.primes:
            raise KeyError(f"layer {layer_id} has no Engram module (engram layers: {self.layer_ids})")
        keep = self.max_ngram_size - 1
        ext, pos, first = [], [], []
        n = 0
        for tokens, history in runs:
            hist = list(history)[-keep:] if keep else []
            ext += hist
            ext += [int(t) for t in tokens]
            pos.append(np.arange(len(tokens), dtype=np.int64) + n + len(hist))
            first.append(np.full(len(tokens), n, dtype=np.int64))
            n += len(hist) + len(tokens)
        if not pos:
            return np.empty((0, self.n_cols), dtype=np.int64)
        vals = self._compress(np.asarray(ext, dtype=np.int64), "token_ids")
        return self._hash(layer_id, vals, np.zeros(n, dtype=bool), np.concatenate(pos), np.concatenate(first))

    def _hash(self, layer_id: int, vals: np.ndarray, dead_ext: np.ndarray, pos: np.ndarray,
              first: np.ndarray) -> np.ndarray:
        """Rows for tokens at indices ``pos`` of the compressed extended sequences ``vals`` (lookbacks stop at
        each token's run start ``first`` or at a dead token)."""
        T = pos.shape[0]
        mult = self.multipliers[layer_id]
        primes = self.primes[layer_id]
        offsets = self.offsets[layer_id]
        out = np.empty((T, self.n_cols), dtype=np.int64)
        blocked = np.zeros(T, dtype=bool)
        rolling = np.zeros(T, dtype=np.int64)
        for s in range(self.max_ngram_size):
            src = pos - s
            before_start = src < first
            src_c = np.maximum(src, first)
            blocked |= before_start | dead_ext[src_c]
            v = np.where(blocked, self.pad, vals[src_c])
            rolling ^= v * mult[s]  # no overflow: v < compressed vocab, see __init__
            if s == 0:
                continue
            assert T == 0 or int(rolling.min()) >= 0
            c0 = (s - 1) * self.n_heads
            cols = slice(c0, c0 + self.n_heads)
            out[:, cols] = rolling[:, None] % primes[None, cols] + offsets[None, cols]
        return out

    def hash_ids_all_layers(self, token_ids, history=None, dead=None, history_dead=None) -> np.ndarray:
        """``int64 [T, n_engram_layers, n_cols]``: :meth:`hash_ids` for every layer in ``layer_ids`` order."""
        return np.stack(
            [self.hash_ids(layer, token_ids, history, dead, history_dead) for layer in self.layer_ids], axis=1
        )

    def next_history(self, token_ids, history=None, dead=None, history_dead=None):
        """Per-request Engram state after committing ``token_ids`` (spec §6.1 "Engram history").

        Returns ``(history int64 [<= max_ngram_size-1], history_dead bool [same])``: the last
        ``max_ngram_size - 1`` token ids of ``history + token_ids`` and their dead flags, ready to pass
        to the next :meth:`hash_ids` call.
        """
        tok = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        hist = np.zeros(0, dtype=np.int64) if history is None else np.asarray(history, dtype=np.int64).reshape(-1)
        hdead = np.zeros(hist.shape[0], dtype=bool) if history_dead is None else np.asarray(history_dead, dtype=bool)
        d = np.zeros(tok.shape[0], dtype=bool) if dead is None else np.asarray(dead, dtype=bool).reshape(-1)
        keep = self.max_ngram_size - 1
        ids = np.concatenate([hist, tok])[-keep:]
        flags = np.concatenate([hdead.reshape(-1), d])[-keep:]
        return ids.copy(), flags.copy()
