"""Which implementation an op runs: the Triton kernel or its PyTorch reference (docs/kernels.md §1).

``$V41_KERNELS`` chooses: ``auto`` (default) runs Triton for CUDA tensors when Triton imports, the reference
otherwise (the CPU fast model always runs the references); ``torch`` always runs the references (a debugging
aid and the GPU tests' comparison point); ``triton`` runs the Triton kernels also on CPU tensors, which only
works under Triton's interpreter (``TRITON_INTERPRET=1``, set before v41 is imported: the CI tests of the
kernels run that way in a subprocess, docs/numerics.md §4a).

Two op families can be set on their own (``v41-serve --moe-backend`` / ``--attention-backend``, docs/kernels.md
§1 "Choosing a path"): ``$V41_MOE_KERNELS`` for the MoE ops (``moe.py``, ``router.py``) and
``$V41_ATTENTION_KERNELS`` for the attention ops (``sparse_attention.py``, ``indexer.py``); each takes the same
modes and, when set, wins over ``$V41_KERNELS`` for its family.
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
FAMILY_ENV = {"moe": "V41_MOE_KERNELS", "attention": "V41_ATTENTION_KERNELS"}


def kernel_mode(family: str | None = None) -> str:
    """``$V41_KERNELS`` (default ``auto``), or for ``family`` (``moe``, ``attention``) its own variable when set.
    Raises ValueError for another value."""
    name = FAMILY_ENV[family] if family is not None and os.environ.get(FAMILY_ENV[family]) else "V41_KERNELS"
    mode = os.environ.get(name, "auto")
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {MODES}, got {mode!r}")
    return mode


def available_modes(device: str) -> tuple[str, ...]:
    """The modes that can run on ``device`` (``cpu``, ``cuda``, ``cuda:N``) here: ``triton`` needs Triton and a
    CUDA device, or Triton's interpreter."""
    gpu = str(device).startswith("cuda")
    return MODES if triton is not None and (gpu or interpreting()) else ("auto", "torch")


def use_triton(*tensors: torch.Tensor, family: str | None = None) -> bool:
    """Whether an op over ``tensors`` (of op ``family``, if it has one) runs its Triton kernel (module
    docstring)."""
    if triton is None:
        return False
    mode = kernel_mode(family)
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
