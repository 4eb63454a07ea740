"""Start-up self-test of a collective backend (KF-20): every rank reduces known data at several sizes and
dtypes; any mismatch disables the backend, and the caller logs why.

Known data: element i of rank r is ``((31·i + 17·r) mod 13 − 6) / 4``, multiples of 1/4 whose sums over up to
8 ranks are exact in bfloat16 and float32, so the expected result is exact and must match bit for bit.
"""

from __future__ import annotations

import torch

from .group import TPGroup

SIZES_BYTES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
DTYPES = (torch.bfloat16, torch.float32)


def known_data(numel: int, rank: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Rank ``rank``'s test message: [numel] of ``dtype`` on ``device``."""
    i = torch.arange(numel, dtype=torch.int64, device=device)
    return (((31 * i + 17 * rank) % 13 - 6).to(torch.float32) / 4).to(dtype)


def run_selftest(group: TPGroup, device: torch.device | str, max_bytes: int = 64 << 20) -> str | None:
    """Reduce and gather known data of 1 KB … ``max_bytes`` in bf16 and fp32 on every rank.

    Returns None when every result is exact, else a reason naming the operation, dtype and size. Collective
    errors (a dead or lagging peer, a refused message) are returned as reasons too, never raised.
    """
    w, r = group.world_size, group.rank
    try:
        for size in [s for s in SIZES_BYTES if s <= max_bytes] or [SIZES_BYTES[0]]:
            for dtype in DTYPES:
                numel = size // dtype.itemsize
                got = group.all_reduce(known_data(numel, r, dtype, device))
                want = sum(known_data(numel, k, torch.float32, device) for k in range(w)).to(dtype)
                if not torch.equal(got, want):
                    bad = int((got != want).sum())
                    return f"all_reduce {dtype} of {size} bytes: {bad} of {numel} elements wrong"
        x = known_data(257, r, torch.bfloat16, device).view(1, -1)
        got = group.all_gather(x, dim=0)
        want = torch.cat([known_data(257, k, torch.bfloat16, device).view(1, -1) for k in range(w)])
        if not torch.equal(got, want):
            return "all_gather of 257 bf16 elements: wrong result"
    except Exception as e:  # a backend that cannot even run the test is as disabled as a wrong one
        return f"{type(e).__name__}: {e}"
    return None
