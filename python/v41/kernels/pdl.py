"""Programmatic dependent launch (PDL) for v41's CUDA and Triton kernels (docs/kernels.md §1 "Launch gaps").

On sm_90 and later a kernel launched with CUDA's programmatic-stream-serialization attribute may be scheduled
while the kernel before it on the stream still runs, once every program of that kernel has executed
``griddepcontrol.launch_dependents``; it executes ``griddepcontrol.wait`` (which returns when the previous kernel
has completed and its writes are visible) before it touches that kernel's data. A decode step is ~600 short
kernels, and this removes most of the gap between each kernel and the next: the next kernel's programs are
resident and waiting, and the weight-streaming GEMM loads its first weights (constants) before the wait, so they
overlap the kernel before it (``cuda/common/pdl.cuh``). A CUDA graph keeps these launches as programmatic edges.

Every kernel launched this way runs :func:`prologue` (Triton) or ``pdl_wait(); pdl_launch_dependents();``
(``cuda/``) before its first dependent access, so the results do not change: only when a kernel may start does.
Kernels that PyTorch launches, and any kernel launched without the attribute, still wait for the whole previous
kernel. :data:`ENABLED` (default on) switches the attribute for every launch: ``--set
v41.kernels.pdl.ENABLED=0`` in the GPU benchmarks. Work joined from another stream (an event wait) is complete
before a kernel passes its wait as well: with :data:`WITH_SIDE_STREAM` (the default) PDL stays on while the side
stream (:mod:`.side_stream`) is, whose GPU test gives the inline logits bit for bit with both on (an H100,
benches/RESULTS.md "2026-12-05 (afternoon)"; the pair was 6 % faster at B = 1, the side stream without PDL 3 %
slower); False turns PDL off for every launch while the side stream is on, steps it does not take included. A
dense weight-streaming GEMM reads its weight before the wait, so a weight must not be written by a kernel of the
same step (weights are constants loaded at start-up).
"""

from __future__ import annotations

import torch

from . import side_stream
from .dispatch import interpreting, tl, triton

ENABLED = True
WITH_SIDE_STREAM = True  # PDL also while side_stream.ENABLED
_CAPABLE: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: :data:`ENABLED`, :data:`.side_stream.ENABLED` off (or
    :data:`WITH_SIDE_STREAM`), a CUDA device of compute capability ≥ 9.0, and not Triton's interpreter."""
    if not ENABLED or (side_stream.ENABLED and not WITH_SIDE_STREAM) or device.type != "cuda" or interpreting():
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


def triton_kw(device: torch.device) -> dict:
    """Launch keywords of a Triton kernel that takes ``PDL: tl.constexpr`` and calls :func:`prologue` first:
    ``{"PDL": True, "launch_pdl": True}`` where :func:`enabled`, else ``{"PDL": False}``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


if triton is not None:
    from triton.language.extra import cuda as _tl_cuda

    @triton.jit
    def prologue(PDL: tl.constexpr):
        """A Triton kernel's first statement: with PDL, wait for the previous kernel, then let the next start."""
        if PDL:
            _tl_cuda.gdc_wait()
            _tl_cuda.gdc_launch_dependents()
