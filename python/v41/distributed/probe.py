"""What the collective backends rely on, probed on this host (docs/numerics.md §4a; issue: "the code checks the
same at start-up"): GPU count and peer access between every pair, pinned host registration, /dev/shm size.
CUDA IPC itself is exercised by the pcie-pull backend when it opens its peers' buffers (its failure disables
the backend with the reason logged).
"""

from __future__ import annotations

import shutil

import numpy as np
import torch


def peer_matrix() -> list[list[bool]]:
    """[n][n]: GPU i can access GPU j's memory directly (diagonal True); [] without CUDA."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]


def pinned_registration_ok(nbytes: int = 1 << 20) -> bool | None:
    """Whether ``cudaHostRegister`` pins an ordinary host buffer of ``nbytes`` (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    buf = np.zeros(nbytes, dtype=np.uint8)
    cudart = torch.cuda.cudart()
    ptr = buf.ctypes.data
    if int(cudart.cudaHostRegister(ptr, nbytes, 0)) != 0:
        return False
    return int(cudart.cudaHostUnregister(ptr)) == 0


def shm_bytes() -> tuple[int, int]:
    """(total, free) bytes of /dev/shm; (0, 0) when it does not exist."""
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return 0, 0
    return usage.total, usage.free


def probe() -> dict:
    """Everything above as one dict (logged by rank 0 at start-up; printed by benches/gpu/tp_bench.py)."""
    total, free = shm_bytes()
    peers = peer_matrix()
    return {"gpus": len(peers), "peer_access": peers, "all_pairs_peer": all(all(r) for r in peers) if peers else None,
            "pinned_host_register": pinned_registration_ok(), "dev_shm_total": total, "dev_shm_free": free}
