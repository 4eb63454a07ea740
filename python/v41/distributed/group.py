"""The tensor-parallel group as the model sees it, how tensors are split across its ranks, and the early check
of a config against a TP size (docs/architecture.md §3 "TP workers"; docs/model.md §8 "TP: heads/groups shard (≤8
groups), indexer heads are small (replicate), KV latent is replicated").

A model built with a :class:`TPGroup` of ``world_size`` W holds on rank r: the attention heads and output
groups ``[r·H/W, (r+1)·H/W)`` / ``[r·G/W, (r+1)·G/W)``, the rows :func:`split_range` gives it of every
routed / shared expert's intermediate dim, of the vocabulary (embedding and LM head) and of each Engram
layer's hash columns. Everything else (q/kv low-rank projections, KV latent, compressors, indexers, routers,
mHC, norms, DSpark heads) is replicated. Each sharded sub-layer ends in exactly one collective
(:meth:`TPGroup.all_reduce` of partial sums, or :meth:`TPGroup.all_gather` of LM-head logits), so every rank
sees the same replicated activations.

Invariant the model relies on: a collective's result is bitwise identical on every rank, so replicated work
(indexer top-k, routing, sampling) takes the same decisions everywhere without further communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError, ModelConfig

MOE_PARALLEL_MODES = ("tp",)
"""How routed experts are split: ``tp`` = every rank holds a slice of every expert's intermediate dim (one
all-reduce per MoE). Expert parallelism (``ep``: experts split by id, tokens routed to their owners) is the
seam left open: it would change :func:`v41.models.sharding.shard_plan`'s expert entries and
:class:`v41.models.reference.moe.MoE`'s local expert list, nothing else."""


class TPGroup:
    """A tensor-parallel group as the model sees it. The base class is the single-rank group (world_size 1:
    every collective is the identity, no communication).

    Subclasses (:class:`v41.distributed.torch_backend.TorchDistGroup`, host-shm / PCIe-pull backends) set
    ``rank``, ``world_size`` and ``name`` and implement the collectives. Every rank must call every collective
    in the same order with tensors of the same shape and dtype.
    """

    rank: int = 0
    world_size: int = 1
    name: str = "single"  # backend name for logs

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over ranks: same shape, dtype and device; bitwise identical on every rank. May work in
        place and return ``x`` (callers pass tensors they own)."""
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation of every rank's ``x`` along ``dim`` in rank order; every rank passes the same shape."""
        return x

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def close(self) -> None:
        """Release the backend's resources (idempotent). The single-rank group has none."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, world_size={self.world_size})"


SINGLE = TPGroup()
"""The single-rank group (stateless, shared): what a model built with ``tp=None`` uses."""


def split_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share ``[start, stop)`` of ``n`` items over ``world_size`` ranks, as even as
    possible: the first ``n % world_size`` ranks get one more. Raises ValueError for ``n < 0``,
    ``world_size < 1`` or a rank outside ``[0, world_size)``."""
    if n < 0:
        raise ValueError(f"split_range: n must not be negative, got {n}")
    if world_size < 1:
        raise ValueError(f"split_range: world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"split_range: rank {rank} outside [0, {world_size})")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class Shard:
    """The slice of one tensor a rank holds: indices ``[start, stop)`` of dimension ``dim``, whose full extent
    is ``full``. Tensors without a Shard are replicated (held whole)."""

    dim: int
    start: int
    stop: int
    full: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def is_full(self) -> bool:
        return self.start == 0 and self.stop == self.full

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The unsharded shape of a tensor whose local shape is ``local_shape``."""
        shape = list(local_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        """This shard of a full tensor ``t`` (a view)."""
        return t.narrow(self.dim, self.start, self.size)


def check_tp(cfg: ModelConfig, world_size: int, moe_parallel: str = "tp") -> None:
    """Check that ``cfg`` can be split over ``world_size`` ranks; call it before building anything.

    Requirements: ``world_size`` divides ``num_attention_heads`` and ``o_groups`` (heads shard by whole output
    groups, so TP ≤ o_groups, docs/model.md §3.5), and is at most ``moe_intermediate_size``,
    ``vocab_size`` and (with Engram) the Engram hash column count ``(engram_max_ngram_size − 1)·engram_n_heads``
    (every rank holds at least one row / column). ``moe_parallel`` must be one of :data:`MOE_PARALLEL_MODES`.
    Raises ValueError (:class:`v41.config.ConfigError`) listing every violated requirement, e.g.
    ``tensor_parallel_size 8 must divide o_groups (4) ...``.
    """
    w = world_size
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    problems = []
    if moe_parallel not in MOE_PARALLEL_MODES:
        problems.append(f"moe_parallel {moe_parallel!r} is not implemented (supported: {MOE_PARALLEL_MODES}; "
                        "'tp' splits every expert's intermediate dim)")
    if cfg.num_attention_heads % w:
        problems.append(f"tensor_parallel_size {w} must divide num_attention_heads ({cfg.num_attention_heads}): "
                        "attention heads are split evenly across ranks")
    if cfg.o_groups % w:
        problems.append(f"tensor_parallel_size {w} must divide o_groups ({cfg.o_groups}): the grouped output "
                        "projection is split by whole groups (TP ≤ o_groups)")
    for field, n, what in (("moe_intermediate_size", cfg.moe_intermediate_size, "expert intermediate rows"),
                           ("vocab_size", cfg.vocab_size, "vocabulary rows")):
        if w > n:
            problems.append(f"tensor_parallel_size {w} exceeds {field} ({n}): every rank needs at least one of "
                            f"the {what}")
    if cfg.engram_layer_ids:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        if w > cols:
            problems.append(f"tensor_parallel_size {w} exceeds the Engram hash columns ((engram_max_ngram_size − 1)"
                            f"·engram_n_heads = {cols}): every rank needs at least one column")
    if problems:
        raise ConfigError("; ".join(problems))
