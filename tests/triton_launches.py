"""Every Triton launch of a kernel check, compiled for the H200 without a GPU (docs/numerics.md §4a).

Triton's interpreter runs a kernel's Python, not its compiler, so it accepts kernels that do not compile (a
variable whose type changes between branches, a loop variable reused after the loop). In the interpreter run
(``python kernel_checks.py CHECK`` with ``$V41_RECORD_LAUNCHES`` set) :func:`record` writes one JSON line per
launch: the kernel, its argument types, its constexpr values and its compile options. ``python triton_launches.py
FILE`` then compiles each distinct launch for sm_90a (``triton.compile``: Triton's code generator, LLVM and its
bundled ``ptxas``; no driver needed) and exits non-zero naming the launches that fail.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys

import torch

TORCH_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
               torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
               torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
               torch.float8_e8m0fnu: "u8"}
OPTIONS = ("num_warps", "num_stages", "maxnreg")


def _constexpr(value):
    """A constexpr value as JSON: Triton dtypes by name."""
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"tl": value.name}
    return value


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TORCH_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def record(path: str) -> None:
    """Append each interpreted launch of this process to ``path`` (JSON lines)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        values = dict(zip(self.arg_names, args))
        values.update({k: v for k, v in kwargs.items() if k in params})
        sig, const = {}, {}
        for name in self.arg_names:
            if "constexpr" in str(params[name].annotation):
                const[name] = _constexpr(values[name])
            else:
                sig[name] = _arg_type(values[name])
        entry = {"module": self.fn.__module__, "name": self.fn.__name__, "sig": sig, "const": const,
                 "options": {k: kwargs[k] for k in OPTIONS if kwargs.get(k)}}
        with open(path, "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def _bf16_only(entry: dict) -> bool:
    """Launches a GPU makes in bf16 only, whose float32 form (the interpreter's) is compiled as the bf16 launch: the
    wide tiling of sparse MQA (the dispatch sends it bf16 chunks; in float32 its 64 × 512 products compile to FMA
    loops for minutes, and would not fit in shared memory)."""
    from v41.kernels import sparse_attention

    return (entry["module"], entry["name"]) == ("v41.kernels.sparse_attention", "_sparse_kernel") and \
        entry["const"]["BH"] == sparse_attention.WIDE[0]


def as_bf16(entry: dict) -> dict:
    """``entry`` with its float32 pointers as bf16 and its dot in bf16 (not IEEE)."""
    sig = {k: "*bf16" if v == "*fp32" and k != "sink_ptr" else v for k, v in entry["sig"].items()}
    const = dict(entry["const"], DOT={"tl": "bf16"}, IEEE=False)
    return dict(entry, sig=sig, const=const)


def compile_launch(entry: dict) -> None:
    """Compile one recorded launch for sm_90a (a :func:`_bf16_only` one as bf16); raises what Triton raises."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if _bf16_only(entry):
        entry = as_bf16(entry)
    fn = getattr(importlib.import_module(entry["module"]), entry["name"])
    sig, const = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in entry["const"]:
            value = entry["const"][name]
            sig[name] = "constexpr"
            const[(i,)] = tl.dtype(value["tl"]) if isinstance(value, dict) else value
        else:
            sig[name] = entry["sig"][name]
    triton.compile(ASTSource(fn, sig, const, {}), target=GPUTarget("cuda", 90, 32), options=entry["options"])


if __name__ == "__main__":  # python triton_launches.py RECORDED.jsonl
    seen, failed = set(), []
    for line in open(sys.argv[1]):
        if line in seen:
            continue
        seen.add(line)
        entry = json.loads(line)
        try:
            compile_launch(entry)
        except Exception as exc:  # noqa: BLE001 — every failure is reported, with its launch
            failed.append(f"{entry['module']}.{entry['name']} {entry['const']}: {type(exc).__name__}: {exc}"[:2000])
    print(json.dumps({"compiled": len(seen) - len(failed), "failed": failed}))
    sys.exit(1 if failed else 0)
