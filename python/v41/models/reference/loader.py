"""``load(path)``: build the reference model from a checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from ...checkpoint import load_into
from ...config import ModelConfig, load_config
from ..engram_hash import EngramHasher, build_compressed_token_map
from .model import Transformer

COMPUTE_DTYPES = (torch.float32, torch.float64)


def engram_hasher(cfg: ModelConfig, tokenizer_path: str | Path) -> EngramHasher | None:
    """The Engram row hasher for ``cfg`` from the checkpoint's ``tokenizer.json`` (None without Engram).
    Raises ValueError naming ``engram_compressed_vocab_size`` if the tokenizer disagrees with the config."""
    if not cfg.engram_layer_ids:
        return None
    from tokenizers import Tokenizer

    token_map = build_compressed_token_map(Tokenizer.from_file(str(tokenizer_path)))
    size = int(token_map.max()) + 1
    if cfg.engram_compressed_vocab_size and size != cfg.engram_compressed_vocab_size:
        raise ValueError(f"engram_compressed_vocab_size: config says {cfg.engram_compressed_vocab_size}, "
                         f"the tokenizer's compressed map has {size} entries")
    hasher = EngramHasher(cfg.engram_layer_ids, token_map, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                          cfg.engram_vocab_size, size, cfg.engram_pad_token_id)
    rows = tuple(hasher.table_rows[i] for i in cfg.engram_layer_ids)
    if cfg.engram_num_embeddings and rows != cfg.engram_num_embeddings:
        raise ValueError(f"engram_num_embeddings: config says {list(cfg.engram_num_embeddings)}, "
                         f"the prime rule gives {list(rows)}")
    return hasher


def build(cfg: ModelConfig, tokenizer_path: str | Path | None, dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu") -> Transformer:
    """An unloaded (zero/one-initialised) reference model for ``cfg`` on ``device`` in ``dtype``."""
    hasher = engram_hasher(cfg, tokenizer_path) if cfg.engram_layer_ids else None
    with torch.device(device):
        model = Transformer(cfg, hasher)
    return model.to(dtype=dtype)


def load(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
         numerics: str = "exact") -> Transformer:
    """Load a V4 or V4.1 checkpoint directory into the reference model.

    dtype: compute dtype, float32 or float64 (weights are dequantized into it once). numerics: ``exact`` or
    ``deployed`` (DESIGN.md §4). Raises ValueError (ConfigError, CheckpointError) for bad configs or
    checkpoints, FileNotFoundError for a missing directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
    cfg = load_config(path)
    model = build(cfg, path / "tokenizer.json", dtype, device)
    load_into(model, path, cfg, dtype)
    return model.eval().set_numerics(numerics)
