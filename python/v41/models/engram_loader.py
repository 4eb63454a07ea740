"""The Engram row hasher of a checkpoint, built from its config and ``tokenizer.json`` (docs/model.md §3.3);
shared by every model implementation and the engine (which hashes each step's rows on the host)."""

from __future__ import annotations

import errno
from pathlib import Path

from ..config import ModelConfig
from .engram_hash import EngramHasher, build_compressed_token_map, compressed_vocab_size


def engram_hasher(cfg: ModelConfig, tokenizer_path: str | Path | None) -> EngramHasher | None:
    """The Engram row hasher for ``cfg`` from the checkpoint's ``tokenizer.json`` (None without Engram).

    Raises FileNotFoundError naming ``tokenizer.json`` when it is missing, ValueError naming the file when the
    tokenizers library cannot read it, and ValueError naming ``engram_compressed_vocab_size`` /
    ``engram_num_embeddings`` if the tokenizer or the prime rule disagrees with the config
    (:meth:`EngramHasher.from_config`)."""
    if not cfg.engram_layer_ids:
        return None
    if tokenizer_path is None or not Path(tokenizer_path).is_file():
        raise FileNotFoundError(errno.ENOENT, "the Engram layers need the checkpoint's tokenizer.json, not found",
                                str(tokenizer_path))
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
        raise ValueError(f"{tokenizer_path}: cannot read the tokenizer ({e})") from None
    token_map = build_compressed_token_map(tokenizer)
    spec = {name: getattr(cfg, name) for name in (
        "engram_layer_ids", "engram_max_ngram_size", "engram_n_heads", "engram_vocab_size", "engram_pad_token_id")}
    # 0 = not given in the config: take the tokenizer's size (nothing to cross-check)
    spec["engram_compressed_vocab_size"] = cfg.engram_compressed_vocab_size or compressed_vocab_size(token_map)
    if cfg.engram_num_embeddings:
        spec["engram_num_embeddings"] = list(cfg.engram_num_embeddings)
    return EngramHasher.from_config(spec, token_map)
