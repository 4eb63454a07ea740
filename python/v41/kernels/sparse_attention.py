"""Sparse MQA with a per-head sink over gathered key rows (v41-architecture.md §3.5 step 4–5; the FlashMLA
sparse interface: every query lists the cache slots it reads, −1 = none)."""

from __future__ import annotations

import torch

from .paged import gather_slots


def sparse_mqa_sink(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor,
                    scale: float, max_rows: int = 1 << 22) -> torch.Tensor:
    """``softmax({q·k·scale : listed keys} ∪ {sink_h})``-weighted sum of the keys (K = V).

    q: [T, H, d]; sources: (cache [S_i, d], slots [T, K_i] int64, −1 = skip) whose keys are concatenated per
    query; sink: [H] (denominator only, unscaled). Queries are processed in chunks so that at most
    ``max_rows`` gathered key elements live at once. Returns [T, H, d] in q's dtype; a query with no valid
    key returns zeros.
    """
    t, h, d = q.shape
    width = sum(s.shape[1] for _, s in sources)
    out = torch.empty_like(q)
    step = max(1, max_rows // max(1, width * d))
    for a in range(0, t, step):
        b = min(t, a + step)
        keys = torch.cat([gather_slots(c, s[a:b]) for c, s in sources], dim=1).to(q.dtype)  # [c, K, d]
        valid = torch.cat([s[a:b] >= 0 for _, s in sources], dim=1)  # [c, K]
        logits = torch.einsum("thd,tkd->thk", q[a:b], keys) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sinks = sink.to(logits.dtype).view(1, h, 1).expand(b - a, h, 1)
        full = torch.cat([logits, sinks], dim=-1)
        probs = torch.softmax(full - full.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        out[a:b] = torch.einsum("thk,tkd->thd", probs, keys)
    return out
