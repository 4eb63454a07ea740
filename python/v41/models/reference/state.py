"""Per-request state of the reference model's incremental path (docs/model.md §6).

The reference keeps every cached row in plain tensors (no paging). Costs per new token are O(context):
window attention reads the last ``sliding_window`` rows, indexers score every cached compressed entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerState:
    """One layer's cached rows.

    kv: [L, head_dim] post-RoPE window KV of positions 0..L-1 (K = V).
    ckv: [N, head_dim] compressed KV entries (compressing layers). idx_k: [N, index_head_dim] index keys.
    carry: compressor state between chunks: V4.1 ratio 2 keeps the pending even-position token's FP32
    ``(a, b)`` rows; V4 keeps the not-yet-closed window's rows and the overlap (A) half of the last window,
    per compressor name ("kv", "index").
    """

    kv: torch.Tensor | None = None
    ckv: torch.Tensor | None = None
    idx_k: torch.Tensor | None = None
    carry: dict = field(default_factory=dict)


def append_rows(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Concatenate rows along dim 0, treating ``None`` as empty."""
    return new if old is None else torch.cat([old, new], dim=0)


@dataclass
class RequestCache:
    """Everything one request carries between forward calls of the reference model.

    num_tokens: tokens processed so far (the next token's position). token_ids: those tokens (Engram
    lookback and DSpark need the ids). layers: per backbone layer. dspark_kv: per DSpark stage, the
    context KV rows [P+1, head_dim] written from ``main_x`` at every target-verified position.
    """

    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    layers: dict[int, LayerState] = field(default_factory=dict)
    dspark_kv: list[torch.Tensor | None] = field(default_factory=list)

    def layer(self, i: int) -> LayerState:
        return self.layers.setdefault(i, LayerState())
