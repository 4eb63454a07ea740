"""``load(path)``: build the reference model from a checkpoint directory."""

from __future__ import annotations

import errno
from pathlib import Path

import torch

from ...checkpoint import load_into
from ...config import ModelConfig, load_config
from ...distributed.group import TPGroup, check_tp
from ..engram_hash import EngramHasher, build_compressed_token_map, compressed_vocab_size
from .model import Transformer
from .random_init import random_init_
from .sharding import shard_plan

COMPUTE_DTYPES = (torch.float32, torch.float64)


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


def build(cfg: ModelConfig, tokenizer_path: str | Path | None, dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu", tp: TPGroup | None = None) -> Transformer:
    """An unloaded (uninitialised) reference model for ``cfg`` on ``device`` in ``dtype``; with ``tp`` only this
    rank's shard (:mod:`.sharding`). Raises ValueError when ``cfg`` cannot be split over ``tp``
    (:func:`v41.distributed.group.check_tp`, checked before the tokenizer is read)."""
    if tp is not None:
        check_tp(cfg, tp.world_size)
    hasher = engram_hasher(cfg, tokenizer_path) if cfg.engram_layer_ids else None
    with torch.device(device):
        model = Transformer(cfg, hasher, tp)
    return model.to(dtype=dtype)


def load(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
         numerics: str = "exact", load_format: str = "auto", seed: int = 0,
         tp: TPGroup | None = None) -> Transformer:
    """Load a V4 or V4.1 checkpoint directory into the reference model.

    dtype: compute dtype, float32 or float64 (weights are dequantized into it once). numerics: ``exact`` or
    ``deployed`` (DESIGN.md §4). load_format: ``auto`` reads the safetensors shards; ``dummy`` only needs
    ``config.json`` (+ ``tokenizer.json``) and fills random weights on ``device`` with ``seed`` (benchmarks).
    tp: the tensor-parallel group (None = one rank): the model holds this rank's shard; the checkpoint reader
    reads only those slices of sharded tensors (quantization-block-aligned, then cut), and dummy weights are
    the slices of the TP=1 dummy weights. Every rank calls ``load`` with the same arguments.
    Raises ValueError (ConfigError, CheckpointError) for bad configs or checkpoints (including a config that
    cannot be split over ``tp``), FileNotFoundError for a missing directory, ``config.json`` or (V4.1 with
    Engram layers) ``tokenizer.json``.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    cfg = load_config(path)
    model = build(cfg, path / "tokenizer.json", dtype, device, tp)
    shards = shard_plan(cfg, model.tp.rank, model.tp.world_size, model.hasher)
    if load_format == "dummy":
        random_init_(model, cfg, seed, shards)
    else:
        load_into(model, path, cfg, dtype, shards)
    return model.eval().set_numerics(numerics)
