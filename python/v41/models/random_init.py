"""Random weights by tensor role: unit-variance activations, peaked logits, mild mHC coefficients. Used by
the tiny checkpoint generator and by ``load_format="dummy"`` (random weights made on the target device).

Under tensor parallelism every rank draws every full tensor in the same order from the same seed and keeps
its shard (:mod:`.sharding`), so TP=N dummy weights are exactly the slices of TP=1's."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..config import ModelConfig
from ..distributed.group import Shard


def init_tensor(name: str, shape: tuple[int, ...], g: torch.Generator, cfg: ModelConfig) -> torch.Tensor:
    """Random values by role: unit-variance activations, peaked logits (head ×4), mild mHC coefficients."""
    def randn(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=g.device) * std

    leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
    if name.endswith("tid2eid"):
        return torch.argsort(torch.rand(shape[0], cfg.n_routed_experts, generator=g, device=g.device), dim=1)[:, : shape[1]]
    if name == "embed.weight" or name.endswith("engram.embed.weight"):
        return randn(1.0)
    if name == "head.weight":
        return randn(4.0 / math.sqrt(shape[1]))
    if "norm" in leaf:
        return 1.0 + randn(0.1)
    if name.endswith(("_fn",)):
        return randn(0.05)
    if name.endswith(("_base", "bias", "bias_vl")):
        return randn(0.3)
    if name.endswith("_scale"):
        return 1.0 + randn(0.1)
    if name.endswith(("attn_sink", ".ape")):
        return randn(0.5)
    if name.endswith(("q_weight", "k_weight")):
        return randn(1.0)
    return randn(1.0 / math.sqrt(shape[-1]))


@torch.no_grad()
def random_init_(model: torch.nn.Module, cfg: ModelConfig, seed: int = 0,
                 shards: Mapping[str, Shard] | None = None) -> None:
    """Fill every parameter and buffer of ``model`` in place (on its device), in name order.

    shards: bare name → the slice this rank holds (:func:`.sharding.shard_plan`); such a tensor is drawn at its
    full shape and cut, so the generator sequence does not depend on the TP size. None: nothing is sharded.
    """
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    shards = shards or {}
    for name in sorted(targets):
        t = targets[name]
        shard = shards.get(name)
        shape = shard.full_shape(tuple(t.shape)) if shard is not None else tuple(t.shape)
        value = init_tensor(name, shape, g, cfg)
        t.copy_((shard.cut(value) if shard is not None else value).to(t.dtype))
