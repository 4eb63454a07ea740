"""Which implementation an op runs: the Triton kernel or its PyTorch reference (docs/kernels.md §1).

``$V41_KERNELS`` chooses: ``auto`` (default) runs Triton for CUDA tensors when Triton imports, the reference
otherwise (the CPU fast model always runs the references); ``torch`` always runs the references (a debugging
aid and the GPU tests' comparison point); ``triton`` runs the Triton kernels also on CPU tensors, which only
works under Triton's interpreter (``TRITON_INTERPRET=1``, set before v41 is imported: the CI tests of the
kernels run that way in a subprocess, docs/numerics.md §4a).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references serve
    triton = None
    tl = None

MODES = ("auto", "torch", "triton")


def kernel_mode() -> str:
    """``$V41_KERNELS`` (default ``auto``). Raises ValueError for another value."""
    mode = os.environ.get("V41_KERNELS", "auto")
    if mode not in MODES:
        raise ValueError(f"V41_KERNELS must be one of {MODES}, got {mode!r}")
    return mode


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether an op over ``tensors`` runs its Triton kernel (module docstring)."""
    if triton is None:
        return False
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "triton":
        return True
    return all(t.is_cuda for t in tensors)


def interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``), which lacks some ops
    (``tl.dot_scaled``): kernels keep a plain-``tl.dot`` branch for it."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_dtype(dtype: torch.dtype):
    """The Triton operand type of ``tl.dot`` for activations of ``dtype`` (bf16, fp16 or fp32)."""
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
