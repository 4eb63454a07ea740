"""Engram in the fast model (docs/model.md §3.3): the step's table rows arrive in the batch (hashed on the
host from committed token ids); rows are gathered from the FP8 table and dequantized, projected by ``wkv`` and
gated into every residual copy in float32.

Offload (docs/engram.md): with ``host`` set the table stays in host memory (:class:`~v41.models.engram_host.HostTable`)
and the step's rows arrive as slot ids ``[T, cols_local]`` into ``slots``, the device row cache the engine's pager
fills before the forward (``engine/engram_pager.py``); the records there are decoded and dequantized the same way.

Tensor parallelism: rank r holds the hash columns ``[c0, c1)`` (:mod:`v41.models.sharding`): their table rows
``[row0, row1)`` and ``wkv``'s input columns; ``wkv``'s partial output is all-reduced before the gate.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...config import ModelConfig
from ...distributed.group import SINGLE, TPGroup, split_range
from ...kernels.engram_fill import fill_slots_reference, fill_slots_uva
from ...kernels.engram_gate import engram_gate
from ...kernels.engram_rows import gather_table_rows
from ...kernels.packed import PackedWeight
from ..engram_host import HostTable
from ..sharding import engram_rows
from .layers import PackedLinear

GATE_FLOOR = 1e-6


class FastEngram(nn.Module):
    """``table`` [rows_local, hd_e] (FP8 + E8M0 per 32, set by the loader), ``wkv [(hc+1)·D, cols_local·hd_e]``,
    ``q_weight``/``k_weight [hc, D]``. ``primes``: the layer's bucket size per hash column."""

    def __init__(self, cfg: ModelConfig, primes, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        self.col0, self.col1 = split_range(len(primes), self.tp.world_size, self.tp.rank)
        self.row0, self.row1 = engram_rows(primes, self.col0, self.col1)
        self.table_rows = sum(int(p) for p in primes)
        cols = self.col1 - self.col0
        self.register_buffer("table", torch.empty(0), persistent=False)
        self.register_buffer("table_scale", None, persistent=False)
        self.table_fmt, self.table_block = "dense", (1, 1)
        self.wkv = PackedLinear(cols * cfg.engram_head_dim, (cfg.hc_mult + 1) * cfg.hidden_size, fp8_input=True)
        self.q_weight = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hidden_size), requires_grad=False)
        self.k_weight = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hidden_size), requires_grad=False)
        self.hc, self.dim, self.eps, self.head_dim = cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps, cfg.engram_head_dim
        self.host: HostTable | None = None  # offload: this rank's rows in host memory
        self.register_buffer("slots", None, persistent=False)  # offload: uint8 [slots, record_bytes] on the device
        self.fill_stream: torch.cuda.Stream | None = None  # offload, uva: the forward fills the slots on it

    def set_host(self, host: HostTable) -> None:
        """Offload: keep the table in ``host`` (rows [row0, row1) of this rank); the device holds only ``slots``."""
        if (host.row0, host.row1) != (self.row0, self.row1) or host.fmt.head_dim != self.head_dim:
            raise ValueError(f"host table rows {host.row0}..{host.row1} × {host.fmt.head_dim}, expected "
                             f"{self.row0}..{self.row1} × {self.head_dim}")
        self.host = host
        self.table = torch.empty(0)

    def set_table(self, w: PackedWeight) -> None:
        want = (self.row1 - self.row0, self.head_dim)
        if w.shape != want:
            raise ValueError(f"Engram table {w.shape}, expected {want}")
        self.table, self.table_scale, self.table_fmt, self.table_block = w.data, w.scale, w.fmt, w.block

    def start_fill(self, copies: Tensor) -> None:
        """Offload, uva: copy the step's misses ``copies`` [2, M] (host rows; slots, −1 = padding) from the pinned
        table into ``slots`` on ``fill_stream``, forked from the current stream (so the copies run beside the layers
        before this one, and after every earlier read of the slots); :meth:`forward` joins it. Capturable."""
        if self.fill_stream is None:  # a CPU device: the PyTorch gather, in order
            fill_slots_reference(self.host.records, copies[0], copies[1], self.slots)
            return
        cur = torch.cuda.current_stream(self.slots.device)
        self.fill_stream.wait_stream(cur)
        with torch.cuda.stream(self.fill_stream):
            fill_slots_uva(self.host.records, copies[0], copies[1], self.slots, check_pinned=False)

    def lookup(self, row_ids: Tensor, dtype: torch.dtype) -> Tensor:
        """row_ids [T, cols] (full table rows; offload: slot ids [T, cols_local]) → this rank's dequantized rows
        flattened [T, cols_local·hd_e]."""
        if self.host is not None:
            if self.fill_stream is not None:
                torch.cuda.current_stream(self.slots.device).wait_stream(self.fill_stream)
            rows = self.host.fmt.decode(self.slots[row_ids.reshape(-1)]).dequantize(dtype)
            return rows.view(row_ids.shape[0], -1)
        table = PackedWeight(self.table, self.table_scale, self.table_fmt, self.table_block)
        return gather_table_rows(table, row_ids, self.col0, self.col1, self.row0, dtype)

    def forward(self, h: Tensor, row_ids: Tensor) -> Tensor:
        """h [T, hc, D] residual copies → ``H + g ⊙ value`` with ``g = sigmoid(sign(s)·sqrt(max(|s|, 1e-6)))``,
        ``s = Σ_d H·w·key / (rms(H)·rms(key)·sqrt(D))`` per copy (float32 math, h's dtype out)."""
        kv = self.tp.all_reduce(self.wkv(self.lookup(row_ids, h.dtype)))
        return engram_gate(h, kv, self.q_weight, self.k_weight, self.eps, GATE_FLOOR)
