"""Which implementation an op runs: a CUDA kernel of ``cuda/`` (the extension ``v41._cuda``), a Triton kernel, or
its PyTorch reference (docs/kernels.md §1).

``$V41_KERNELS`` chooses: ``auto`` (default) runs, for CUDA tensors, an op's CUDA kernel where the extension is
built for the device (``sm_90a``: compute capability 9.0) and the shape is one the kernel takes, else its Triton
kernel when Triton imports, else the reference (the CPU fast model always runs the references); ``cuda`` is
``auto`` that also insists the extension loads (a ValueError otherwise); ``triton`` never runs the CUDA kernels
and runs the Triton kernels on CUDA tensors, and also on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set before v41 is imported: the CI tests of the kernels run that way in a subprocess,
docs/numerics.md §4a; without it a CPU tensor runs the reference, as a reference computed on the CPU next to a GPU
kernel does); ``torch`` always runs the references (a debugging aid and the GPU tests' comparison point).

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

MODES = ("auto", "torch", "triton", "cuda")
FAMILY_ENV = {"moe": "V41_MOE_KERNELS", "attention": "V41_ATTENTION_KERNELS"}
_UNSET = object()
_CUDA_EXT = _UNSET
_CUDA_WHY = ["not loaded"]
_CUDA_RUNS: dict[int, bool] = {}
_SM_COUNT: dict[int, int] = {}


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
    CUDA device, or Triton's interpreter; ``cuda`` needs the extension built for that CUDA device."""
    gpu = str(device).startswith("cuda")
    modes = ("auto", "torch") + (("triton",) if triton is not None and (gpu or interpreting()) else ())
    return modes + (("cuda",) if gpu and cuda_runs_on(torch.device(device)) else ())


def cuda_ext():
    """The extension ``v41._cuda`` (built by ``cuda/build.py``), or None when it is absent or does not load."""
    global _CUDA_EXT
    if _CUDA_EXT is _UNSET:
        try:
            from .. import _cuda
        except ImportError as e:
            _CUDA_EXT = None
            _CUDA_WHY[0] = f"not built ({e})"
        else:
            _CUDA_EXT = _cuda
    return _CUDA_EXT


def cuda_status(device: torch.device | None = None) -> str:
    """One line for ``v41 --version`` and the start-up log: whether the CUDA kernels can run (on ``device``, or
    the current CUDA device) and why not."""
    ext = cuda_ext()
    if ext is None:
        return f"unavailable: {_CUDA_WHY[0]}"
    archs = ", ".join(ext.ARCHS)
    if not torch.cuda.is_available():
        return f"built for {archs}; no CUDA device here"
    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(dev)
    state = "runs" if cuda_runs_on(dev) else "does not run"
    return f"built for {archs}; {state} on {torch.cuda.get_device_name(dev)} (sm_{major}{minor})"


def cuda_runs_on(device: torch.device) -> bool:
    """Whether the extension loads and holds code for ``device``'s architecture (a CUDA device)."""
    ext = cuda_ext()
    if ext is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _CUDA_RUNS:
        major, minor = torch.cuda.get_device_capability(key)
        _CUDA_RUNS[key] = f"sm_{major}{minor}a" in ext.ARCHS or f"sm_{major}{minor}" in ext.ARCHS
    return _CUDA_RUNS[key]


def use_cuda(*tensors: torch.Tensor, family: str | None = None) -> bool:
    """Whether an op over ``tensors`` (of op ``family``) may run its CUDA kernel: mode ``auto`` or ``cuda``, every
    tensor on one CUDA device the extension runs on. The op still checks the shapes its kernel takes. Raises
    ValueError in mode ``cuda`` for CUDA tensors when the extension does not load."""
    mode = kernel_mode(family)
    if mode not in ("auto", "cuda") or not tensors or not all(t.is_cuda for t in tensors):
        return False
    if mode == "cuda" and cuda_ext() is None:
        raise ValueError(f"kernel mode 'cuda': v41._cuda is {_CUDA_WHY[0]}; build it with `make cuda`")
    dev = tensors[0].device
    return all(t.device == dev for t in tensors) and cuda_runs_on(dev)


# op → (family, where its CUDA kernel runs), for the ops with a CUDA kernel
CUDA_OPS = {"dense linears": (None, "at decode sizes"), "MoE experts": ("moe", "at decode sizes"),
            "sparse attention": ("attention", "for bf16"), "indexer top-k": ("attention", "for float32 scores"),
            "indexer scores": ("attention", "over long contexts"), "mHC seams": (None, "at decode sizes"),
            "MoE router": ("moe", "at decode sizes")}
TRITON_ONLY = {"other ops": None}


def describe_paths(device: str) -> str:
    """One line naming the path of each op family on ``device`` (the engine's start-up log)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "PyTorch references (CPU)" if not interpreting() else "Triton interpreter / PyTorch references"
    parts = []
    ops = [(op, family, where) for op, (family, where) in CUDA_OPS.items()]
    for op, family, where in ops + [(op, family, None) for op, family in TRITON_ONLY.items()]:
        mode = kernel_mode(family)
        path = "PyTorch" if mode == "torch" or triton is None else "Triton"
        if where is not None and mode in ("auto", "cuda") and cuda_runs_on(dev):
            path = f"CUDA {where}, else {path}"
        if op == "sparse attention" and path != "PyTorch":
            from .sparse_attention import WIDE_MIN_TOKENS  # sparse_attention imports this module

            if WIDE_MIN_TOKENS:
                path = f"Triton wide for steps of ≥ {WIDE_MIN_TOKENS} tokens over bf16 rows, {path}"
        parts.append(f"{op}: {path}")
    from .pdl import enabled as pdl_enabled  # pdl imports this module

    pdl = torch.cuda.is_available() and pdl_enabled(dev)
    parts.append("launches: " + ("programmatic dependent (PDL)" if pdl else "serial"))
    return "; ".join(parts) + f" (CUDA kernels {cuda_status(dev)})"


def use_triton(*tensors: torch.Tensor, family: str | None = None) -> bool:
    """Whether an op over ``tensors`` (of op ``family``, if it has one) runs its Triton kernel (module
    docstring)."""
    if triton is None:
        return False
    mode = kernel_mode(family)
    if mode == "torch":
        return False
    if mode == "triton" and interpreting():
        return True
    return all(t.is_cuda for t in tensors)  # auto, cuda: ops without a CUDA kernel run Triton


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (the current device when it has no index), cached."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``), which lacks some ops
    (``tl.dot_scaled``): kernels keep a plain-``tl.dot`` branch for it."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_dtype(dtype: torch.dtype):
    """The Triton operand type of ``tl.dot`` for activations of ``dtype`` (bf16, fp16 or fp32)."""
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
