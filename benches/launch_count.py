"""Kernel launches in one decode step of the fast model, counted on the CPU (no GPU needed; benches/RESULTS.md
"2026-12-04 (fewer launches)").

    python benches/launch_count.py [--arch v41|v4] [--batch 1] [--list]

Builds a tiny model (V4.1 with flash-slice-v41's layer roles: ratios 0, 0, 2, 2, 2, 1, 1, 1, 1, index sources
2, 4, 5, 7, candidate source 5, Engram layers 1 and 4; or the tiny V4), prefills ``--batch`` requests of 70
tokens with fp8 cache records, then runs one decode step with the Triton kernels under Triton's interpreter
(``V41_KERNELS=triton``) and counts, inside the model's forward only, the PyTorch ops that launch a kernel on a GPU
(views, allocations and casts to the same dtype excluded) and the Triton launches. The interpreter takes the
Triton path where a GPU would take a CUDA kernel (the weight-streaming GEMM, sparse MQA, the mHC seam, the
router, the radix top-k), so the totals are not the GPU's; the PyTorch ops of the references behind those CUDA
kernels (``topk.py``, ``linear.py``) are reported apart. Differences between two commits are what a GPU sees.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import traceback

os.environ["TRITON_INTERPRET"] = "1"
os.environ["V41_KERNELS"] = "triton"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

NO_LAUNCH = {"view", "_unsafe_view", "detach", "alias", "as_strided", "t", "transpose", "unsqueeze", "squeeze",
             "expand", "slice", "select", "split", "split_with_sizes", "permute", "reshape", "unbind",
             "_reshape_alias", "lift_fresh", "empty", "empty_strided", "empty_like", "sym_size", "sym_stride",
             "is_same_size", "promote_types", "result_type", "_to_copy"}
CUDA_ON_GPU = ("kernels/topk.py", "kernels/linear.py")  # references of ops a GPU runs as CUDA / Triton kernels
V41_SLICE_ROLES = dict(num_hidden_layers=9, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 1],
                       kv_source_layer_ids=[2, 4, 5], index_source_layer_ids=[2, 4, 5, 7], candidate_source_layer_id=5,
                       candidate_topk_blocks=64, candidate_block_size=8, engram_layer_ids=[1, 4],
                       num_nextn_predict_layers=0, dspark_target_layer_ids=[], index_topk=16)


class Counter(TorchDispatchMode):
    """PyTorch ops (name, call site in v41) and Triton launches while :attr:`on`; ops issued by Triton's interpreter
    itself are not counted."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.triton: collections.Counter = collections.Counter()
        self.on = False
        self._in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if self.on and not self._in_kernel and name not in NO_LAUNCH:
            site = next((f"{fr.filename.split('/v41/')[-1]}:{fr.lineno}" for fr in reversed(traceback.extract_stack())
                         if "/v41/" in fr.filename and "dispatch.py" not in fr.filename), "?")
            self.ops[(name, site)] += 1
        return func(*args, **(kwargs or {}))

    def hook_triton(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        original, counter = InterpretedFunction.run, self

        def run(fn, *args, **kwargs):
            if counter.on and not counter._in_kernel:
                counter.triton[fn.fn.__name__] += 1
            outer, counter._in_kernel = counter._in_kernel, True
            try:
                return original(fn, *args, **kwargs)
            finally:
                counter._in_kernel = outer

        InterpretedFunction.run = run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=("v41", "v4"), default="v41")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--list", action="store_true", help="every PyTorch op by call site, and the Triton kernels")
    a = ap.parse_args()
    from v41.engine.args import EngineArgs
    from v41.engine.core import EngineCore
    from v41.engine.params import SamplingParams
    from v41.testing.tiny import make_tiny

    random.seed(0)
    torch.manual_seed(0)
    root = tempfile.mkdtemp()
    path = (make_tiny(f"{root}/m", "deepseek_v41", **V41_SLICE_ROLES) if a.arch == "v41"
            else make_tiny(f"{root}/m", "deepseek_v4"))
    core = EngineCore(EngineArgs(model=str(path), device="cpu", max_num_seqs=max(4, a.batch),
                                 enable_prefix_caching=False, kv_cache_dtype="fp8"))
    for i in range(a.batch):
        core.add_request(f"r{i}", [random.randrange(5, 200) for _ in range(70)],
                         SamplingParams(temperature=1.0, seed=i, ignore_eos=True, max_tokens=None))
    while any(len(s.output_token_ids) == 0 for s in core.seqs.values()):
        core.step()  # prefill
    counter = Counter()
    counter.hook_triton()
    forward = core.executor.runner.model.forward

    def counted(*args, **kwargs):
        counter.on = True
        try:
            with counter:
                return forward(*args, **kwargs)
        finally:
            counter.on = False

    core.executor.runner.model.forward = counted
    core.step()
    glue = sum(n for (_, site), n in counter.ops.items() if not site.startswith(CUDA_ON_GPU))
    behind_cuda = sum(counter.ops.values()) - glue
    triton = sum(counter.triton.values())
    print(f"{a.arch} B={a.batch}: {glue} PyTorch launches + {triton} Triton launches = {glue + triton} "
          f"(and {behind_cuda} PyTorch ops of references a GPU runs as CUDA kernels)")
    if a.list:
        for (name, site), n in sorted(counter.ops.items(), key=lambda kv: kv[0][1]):
            print(f"  {n:4d} {name:24s} {site}")
        for name, n in sorted(counter.triton.items()):
            print(f"  {n:4d} {name}")


if __name__ == "__main__":
    main()
