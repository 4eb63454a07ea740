"""``load(path)``: build the reference model from a checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from ...checkpoint import load_into
from ...config import ModelConfig, load_config
from ...distributed.group import TPGroup, check_tp
from ..engram_loader import engram_hasher
from ..sharding import shard_plan
from .model import Transformer
from ..random_init import random_init_

COMPUTE_DTYPES = (torch.float32, torch.float64)


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
         tp: TPGroup | None = None, config_overrides: dict | None = None) -> Transformer:
    """Load a V4 or V4.1 checkpoint directory into the reference model.

    dtype: compute dtype, float32 or float64 (weights are dequantized into it once). numerics: ``exact`` or
    ``deployed`` (docs/numerics.md §4). load_format: ``auto`` reads the safetensors shards; ``dummy`` only needs
    ``config.json`` (+ ``tokenizer.json``) and fills random weights on ``device`` with ``seed`` (benchmarks).
    tp: the tensor-parallel group (None = one rank): the model holds this rank's shard; the checkpoint reader
    reads only those slices of sharded tensors (quantization-block-aligned, then cut), and dummy weights are
    the slices of the TP=1 dummy weights. Every rank calls ``load`` with the same arguments.
    config_overrides: fields replacing those of ``config.json`` (:func:`v41.config.load_config`).
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
    cfg = load_config(path, config_overrides)
    model = build(cfg, path / "tokenizer.json", dtype, device, tp)
    shards = shard_plan(cfg, model.tp.rank, model.tp.world_size, model.hasher)
    if load_format == "dummy":
        random_init_(model, cfg, seed, shards)
    else:
        load_into(model, path, cfg, dtype, shards)
    return model.eval().set_numerics(numerics)
