"""The fast model: bf16 activations, FP8 / MXFP4 weights dequantized in the kernels, no host synchronisation in a
forward (docs/architecture.md §2 ``models/fast``, §3a). ``load_fast(path, ...)`` builds it from a checkpoint."""

from .loader import load_fast
from .model import FastModel

__all__ = ["FastModel", "load_fast"]
