"""Build the CUDA extension ``v41._cuda`` from ``cuda/`` (docs/kernels.md §1 "CUDA kernels").

    python cuda/build.py                 # build python/v41/_cuda.so for sm_90a (``make cuda``)
    python cuda/build.py --check         # compile every .cu for sm_90a, sm_100a and sm_120a, link nothing

The extension is made by ``torch.utils.cpp_extension.load`` (ninja) from ``cuda/bindings*.cpp`` and every ``*.cu``
under ``cuda/``, in ``build/cuda/``, and copied to ``python/v41/_cuda.so``; v41 runs without it (the Triton and
PyTorch paths serve). ``--check`` compiles the kernels alone (no torch headers), which is what CI can afford.

nvcc comes from ``$CUDA_HOME``, else ``nvcc`` on the PATH, else PyPI's ``nvidia-cuda-nvcc`` in this environment
(install it with ``pip install "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*"
"nvidia-cuda-crt==13.0.*"``: newer releases emit code that the 13.0 driver of the device machine rejects). Exit
status 1 with a message when no nvcc is found or a compile fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "cuda"
BUILD_DIR = ROOT / "build" / "cuda"
TARGET = ROOT / "python" / "v41" / "_cuda.so"
ARCHS = ("90a",)
CHECK_ARCHS = ("90a", "100a", "120a")
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]


def cuda_home() -> Path:
    """The toolkit root: ``$CUDA_HOME``, the folder above ``nvcc`` on the PATH, or the PyPI wheels' folder."""
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"])
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(nvcc).resolve().parents[1]
    wheel = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13"
    if (wheel / "bin" / "nvcc").exists():
        return wheel
    sys.exit("cuda/build.py: no nvcc (set CUDA_HOME, put nvcc on the PATH, or pip install nvidia-cuda-nvcc==13.0.*)")


def gencode(arch: str) -> str:
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def sources() -> list[Path]:
    return sorted(CUDA_DIR.rglob("*.cu"))


def check(home: Path, archs: tuple[str, ...]) -> None:
    """Compile each kernel source for each arch into a throwaway object."""
    out = BUILD_DIR / "check"
    out.mkdir(parents=True, exist_ok=True)
    for src in sources():
        for arch in archs:
            cmd = [str(home / "bin" / "nvcc"), *NVCC_FLAGS, gencode(arch), f"-I{home / 'include'}", "-c", str(src),
                   "-o", str(out / f"{src.stem}.{arch}.o")]
            print(f"nvcc {src.relative_to(ROOT)} sm_{arch}", flush=True)
            if subprocess.run(cmd).returncode:
                sys.exit(f"cuda/build.py: {src.relative_to(ROOT)} failed for sm_{arch}")


def _cudart_shim(home: Path) -> list[str]:
    """Link flags that find libcudart: the PyPI runtime ships only ``libcudart.so.13``, so link a private
    ``libcudart.so`` to it."""
    for lib in ("lib64", "lib"):
        if (home / lib / "libcudart.so").exists():
            return [f"-L{home / lib}"]
    real = next((home / "lib").glob("libcudart.so.*"), None)
    if real is None:
        return []
    shim = BUILD_DIR / "libshim"
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "libcudart.so"
    if not link.exists():
        link.symlink_to(real)
    return [f"-L{shim}"]


def build(home: Path, archs: tuple[str, ...]) -> Path:
    """Build the extension and copy it to ``python/v41/_cuda.so``; returns that path."""
    os.environ["CUDA_HOME"] = str(home)
    # nvcc and this environment's ninja first on the PATH
    os.environ["PATH"] = os.pathsep.join([str(home / "bin"), str(Path(sys.executable).parent),
                                          os.environ.get("PATH", "")])
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    from torch.utils.cpp_extension import load

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    bindings = sorted(CUDA_DIR.glob("bindings*.cpp"))
    mod = load(name="_cuda", sources=[*map(str, bindings), *map(str, sources())],
               build_directory=str(BUILD_DIR),
               extra_cflags=["-O3", "-std=c++17", "-DV41_ARCHS=" + ",".join("sm_" + a for a in archs)],
               extra_cuda_cflags=[*NVCC_FLAGS, *map(gencode, archs)], extra_include_paths=[str(CUDA_DIR)],
               extra_ldflags=_cudart_shim(home), verbose=False)
    shutil.copyfile(mod.__file__, TARGET)
    return TARGET


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compile the kernels for every arch, build nothing")
    ap.add_argument("--archs", default=None, help="comma-separated, e.g. 90a,100a (default: 90a; --check: all)")
    args = ap.parse_args(argv)
    home = cuda_home()
    archs = tuple(args.archs.split(",")) if args.archs else (CHECK_ARCHS if args.check else ARCHS)
    if args.check:
        check(home, archs)
        print(f"cuda/build.py: {len(sources())} sources compile for {', '.join('sm_' + a for a in archs)}")
    else:
        print(f"cuda/build.py: built {build(home, archs).relative_to(ROOT)} for {', '.join('sm_' + a for a in archs)}")


if __name__ == "__main__":
    main()
