"""Which slice of which tensor a tensor-parallel rank holds (docs/model.md §8 "TP"; docs/architecture.md §3).

One pure description, used by the modules (their local sizes), by checkpoint loading (which slices to read)
and by ``random_init_`` (which slice of the full random tensor to keep), so the three cannot disagree:

==========================================  ===  =====================================================
tensor (bare name, per layer / stage)        dim  rank r of W holds
==========================================  ===  =====================================================
``attn.wq_b.weight [H·hd, q_lora]``          0    rows of heads ``[r·H/W, (r+1)·H/W)``
``attn.attn_sink [H]``                       0    those heads
``attn.wo_a.weight [G·R, H·hd/G]``           0    rows of groups ``[r·G/W, (r+1)·G/W)`` (§3.5 step 7)
``attn.wo_b.weight [D, G·R]``                1    columns of those groups
``ffn.experts.E.w1/w3.weight [I, D]``        0    ``split_range(I, W, r)`` (every expert; TP over I)
``ffn.experts.E.w2.weight [D, I]``           1    the same range
``ffn.shared_experts.w1/w3 / w2``            0/1  the same range
``engram.embed.weight [rows, hd_e]``         0    table rows of hash columns ``split_range(cols, W, r)``
``engram.wkv.weight [(hc+1)·D, cols·hd_e]``  1    input columns of those hash columns
``embed.weight`` / ``head.weight [V, D]``    0    ``split_range(V, W, r)`` (vocab-parallel)
==========================================  ===  =====================================================

Everything else is replicated: ``wq_a``, ``q_norm``, ``wkv``, ``kv_norm`` (the MQA latent, §3.5), compressors,
indexers (small heads, §8), routers (``gate.*``, ``tid2eid``), mHC, norms, Engram ``q_weight``/``k_weight``,
DSpark ``main_proj``/``main_norm``/``norm``/``markov_head``/``confidence_head``, V4 ``hc_head_*``. The DSpark
stages' attention and experts (``mtp.S.*``) shard like a layer's, or are replicated whole with
``draft_tensor_parallel_size`` 1 (``draft_sharded=False``).

Engram column c owns the table rows ``[offsets[c], offsets[c] + primes[c])`` (§3.3 "Prime buckets":
the table is the concatenation of the columns' bucket ranges), so a contiguous column range owns a contiguous
row range.

Deployed numerics: the FP8 activation quantization before a row-parallel GEMM (``wo_b``, ``w2``, Engram ``wkv``)
runs per 32 inputs of the local slice. Its scales are powers of two, so a 32-block split across ranks (a slice
boundary not at a multiple of 32, e.g. the tiny model's 16-wide expert slices at TP=4) only changes elements in
E4M3's subnormal range; real V4.1 slices (1024-wide groups, 2304/W expert rows, 256-wide Engram heads) align.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import ModelConfig
from ..distributed.group import Shard, split_range
from .engram_hash import EngramHasher


def head_range(cfg: ModelConfig, world_size: int, rank: int) -> tuple[int, int]:
    """Attention heads ``[h0, h1)`` of ``rank`` (needs ``world_size | num_attention_heads``, see check_tp)."""
    n = cfg.num_attention_heads // world_size
    return rank * n, (rank + 1) * n


def group_range(cfg: ModelConfig, world_size: int, rank: int) -> tuple[int, int]:
    """Output groups ``[g0, g1)`` of ``rank`` (needs ``world_size | o_groups``); they hold exactly the heads
    of :func:`head_range` (group k = heads ``k·H/G .. (k+1)·H/G − 1``)."""
    n = cfg.o_groups // world_size
    return rank * n, (rank + 1) * n


def engram_columns(cfg: ModelConfig) -> int:
    """Hash columns of an Engram layer, ``(engram_max_ngram_size − 1)·engram_n_heads`` (§3.3)."""
    return (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads


def engram_rows(primes: Sequence[int], c0: int, c1: int) -> tuple[int, int]:
    """Table rows ``[r0, r1)`` owned by hash columns ``[c0, c1)`` of a layer whose columns have bucket sizes
    ``primes`` (column c starts at ``offsets[c] = Σ_{k<c} primes[k]``)."""
    r0 = sum(int(p) for p in primes[:c0])
    return r0, r0 + sum(int(p) for p in primes[c0:c1])


def shard_plan(cfg: ModelConfig, rank: int, world_size: int,
               hasher: EngramHasher | None = None, draft_sharded: bool = True) -> dict[str, Shard]:
    """Bare tensor name → :class:`Shard` for every tensor that is split across ranks (module docstring);
    tensors not listed are replicated. At ``world_size`` 1 every Shard covers its whole dimension.

    hasher: needed for Engram layers (their columns' bucket sizes). Raises ValueError when it is missing.
    draft_sharded: False replicates the DSpark stages (``mtp.*``) on every rank (``draft_tensor_parallel_size``
    1; their embedding and LM head are the target's, vocab-parallel as always).
    The caller checks the config first (:func:`v41.distributed.group.check_tp`).
    """
    split = (lambda n: split_range(n, world_size, rank))
    plan: dict[str, Shard] = {}
    hd, r_o = cfg.head_dim, cfg.o_lora_rank
    h0, h1 = head_range(cfg, world_size, rank)
    g0, g1 = group_range(cfg, world_size, rank)
    i0, i1 = split(cfg.moe_intermediate_size)
    inter = cfg.moe_intermediate_size

    def attention(prefix: str) -> None:
        h, g = cfg.num_attention_heads, cfg.o_groups
        plan[f"{prefix}attn.wq_b.weight"] = Shard(0, h0 * hd, h1 * hd, h * hd)
        plan[f"{prefix}attn.attn_sink"] = Shard(0, h0, h1, h)
        plan[f"{prefix}attn.wo_a.weight"] = Shard(0, g0 * r_o, g1 * r_o, g * r_o)
        plan[f"{prefix}attn.wo_b.weight"] = Shard(1, g0 * r_o, g1 * r_o, g * r_o)

    def experts(prefix: str, n_experts: int) -> None:
        names = [f"{prefix}ffn.experts.{e}." for e in range(n_experts)]
        if cfg.n_shared_experts:
            names.append(f"{prefix}ffn.shared_experts.")
        for p in names:  # TP over the intermediate dim (the only MOE_PARALLEL_MODES entry; EP would go here)
            plan[f"{p}w1.weight"] = plan[f"{p}w3.weight"] = Shard(0, i0, i1, inter)
            plan[f"{p}w2.weight"] = Shard(1, i0, i1, inter)

    for layer in cfg.plan:
        prefix = f"layers.{layer.layer_id}."
        attention(prefix)
        experts(prefix, cfg.n_routed_experts)
        if layer.engram:
            if hasher is None:
                raise ValueError("shard_plan: engram_layer_ids is set but no EngramHasher was given")
            primes = hasher.primes[layer.layer_id]
            c0, c1 = split(len(primes))
            r0, r1 = engram_rows(primes, c0, c1)
            hde = cfg.engram_head_dim
            plan[f"{prefix}engram.embed.weight"] = Shard(0, r0, r1, hasher.table_rows[layer.layer_id])
            plan[f"{prefix}engram.wkv.weight"] = Shard(1, c0 * hde, c1 * hde, len(primes) * hde)
    if cfg.has_dspark and draft_sharded:
        for s in range(cfg.num_nextn_predict_layers):
            attention(f"mtp.{s}.")
            experts(f"mtp.{s}.", cfg.dspark_n_routed_experts)
    v0, v1 = split(cfg.vocab_size)
    plan["embed.weight"] = plan["head.weight"] = Shard(0, v0, v1, cfg.vocab_size)
    return plan
