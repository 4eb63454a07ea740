"""The indexer's deterministic top-k (``kernels/topk.py``) on long rows: one ``torch.topk`` over the int64 order
keys against the two-stage ``top_keys``, at the shapes of a decode step at 128k–1M context and of a prefill row
chunk (µs by events, median of 20 after a warm-up; the order-key launch included). Prints a table last.

    python3 benches/gpu/topk_bench.py
"""

from __future__ import annotations

import torch

from event_timing import median_ms
from v41.kernels import topk

SHAPES = [(1, 1 << 20, 512), (1, 1 << 19, 512), (1, 1 << 17, 2048), (1, 1 << 17, 512), (8, 1 << 20, 512),
          (32, 1 << 20, 512), (64, 1 << 17, 512), (2048, 1 << 14, 512)]


def main() -> None:
    rows = []
    default = topk.SEGMENT
    for t, n, k in SHAPES:
        scores = torch.randn(t, n, device="cuda")
        scores[:, n // 2:] = float("-inf")  # half the entries not visible, as mid-context
        us = {}
        for name, seg in (("one stage", 1 << 40), ("two stages", default)):
            topk.SEGMENT = seg
            out = topk.stable_topk(scores, k)
            us[name] = median_ms(lambda: topk.stable_topk(scores, k), 20) * 1e3
            us[name + " ids"] = out
        topk.SEGMENT = default
        same = torch.equal(us.pop("one stage ids"), us.pop("two stages ids"))
        rows.append((t, n, k, us["one stage"], us["two stages"], same))
    print(f"{torch.cuda.get_device_name()}; SEGMENT {default}")
    print("| rows | N | k | one stage µs | two stages µs | speed-up | same ids |")
    print("|---|---|---|---|---|---|---|")
    for t, n, k, a, b, same in rows:
        print(f"| {t} | {n:,} | {k} | {a:.1f} | {b:.1f} | {a / b:.2f}× | {same} |")


if __name__ == "__main__":
    main()
