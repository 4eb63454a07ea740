"""Build the FlashMLA comparison extension (``benches/gpu/flashmla/shim.cpp`` over the sources that
``stage.sh`` put in ``.flashmla/``) with torch.utils.cpp_extension and ninja, for sm_90a, and import it (built in
torch's extensions folder, outside the repo; about 60 s of nvcc for the decode kernel on one core).

    python3 benches/gpu/flashmla/flashmla_ext.py        # build only (prints the seconds it took)

:func:`load` returns the module (``plan``, ``sparse_decode``), or None with the reason printed when the staged
sources or nvcc are missing. FlashMLA's own compile flags (its setup.py), minus the source-in-PTX and line
information that only profiling needs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STAGED = ROOT / ".flashmla"
SOURCES = ["csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
           "csrc/sm90/prefill/sparse/instantiations/phase1_k512.cu",
           "csrc/smxx/decode/combine/combine.cu",
           "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu"]
NVCC_FLAGS = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
              "--use_fast_math", "-gencode=arch=compute_90a,code=sm_90a"]


def load(verbose: bool = False):
    """The built module, or None (the reason printed) without staged sources or a CUDA toolkit."""
    if not (STAGED / SOURCES[0]).exists():
        print(f"flashmla: no staged sources in {STAGED} (run benches/gpu/flashmla/stage.sh and carry .flashmla)")
        return None
    from torch.utils.cpp_extension import CUDA_HOME, load as load_ext
    if CUDA_HOME is None:
        print("flashmla: no CUDA toolkit (nvcc) found")
        return None
    csrc = STAGED / "csrc"
    includes = [csrc, csrc / "kerutils" / "include", csrc / "sm90", STAGED / "cutlass" / "include"]
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    return load_ext(name="v41_flashmla_sm90", sources=[str(Path(__file__).with_name("shim.cpp"))]
                    + [str(STAGED / s) for s in SOURCES],
                    extra_include_paths=[str(p) for p in includes],
                    extra_cflags=["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"],
                    extra_cuda_cflags=NVCC_FLAGS, verbose=verbose)


if __name__ == "__main__":
    t0 = time.perf_counter()
    mod = load(verbose=True)
    print(f"flashmla: {'built' if mod is not None else 'not built'} in {time.perf_counter() - t0:.0f} s")
    sys.exit(0 if mod is not None else 1)
