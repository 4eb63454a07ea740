"""Where a flash-slice step's time goes (torch.profiler on the GPU machine; nsys cannot make reports there).

    python3 benches/gpu/profile_step.py --slice v4 --batch 1 --context 2048 [--prefill 2048] [--top 25]
        [--kv-cache-dtype fp8] [--set v41.kernels.pdl.ENABLED=0 --set v41.kernels.side_stream.ENABLED=0]

Builds the engine as ``flash_slice.py`` does, prefills ``batch`` requests to ``context``, then profiles 5 decode
steps (and one prefill of ``--prefill`` tokens) and prints the kernels by CUDA time, the launches per step and the
host time per step. With programmatic dependent launch on (``kernels/pdl.py``, the default on sm_90) a kernel's
time includes its programs' wait for the kernel before it, and at up to 8 tokens the side stream
(``kernels/side_stream.py``) runs kernels at the same time, so the times overlap: ``--set v41.kernels.pdl.ENABLED=0 --set
v41.kernels.side_stream.ENABLED=0`` gives the per-kernel breakdown.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flash_slice import apply_overrides, decode_headroom, v41_engine, write_config


def show(prof, steps: int, top: int, title: str) -> None:
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    print(f"\n== {title}: {total_us / steps / 1e3:.2f} ms GPU time and {launches / steps:.0f} kernels per step")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"{e.self_device_time_total / steps / 1e3:9.3f} ms {e.count // steps:6d}x  {e.key[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slice", choices=("v4", "v41"), default="v4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="a kernel switch, as flash_slice.py's (e.g. v41.kernels.pdl.ENABLED=0)")
    a = ap.parse_args()
    apply_overrides(a.set)
    from v41.engine.params import SamplingParams

    path = write_config(Path(tempfile.mkdtemp()), a.slice)
    budget = max(a.prefill, 256)
    max_len = max(a.context + decode_headroom(a.batch, a.context, budget, steps=40), a.prefill + 80)
    core = v41_engine(path, a.batch, budget, max_len, "auto", kv_cache_dtype=a.kv_cache_dtype)
    if a.eager:
        core.executor.runner.graphs = None
    rng = random.Random(0)
    vocab = core.cfg.vocab_size
    for i in range(a.batch):
        core.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(a.context)],
                         SamplingParams(temperature=1.0, seed=i, ignore_eos=True, max_tokens=None))
    while any(len(s.output_token_ids) == 0 for s in core.seqs.values()):
        core.step()
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            core.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 5
    show(prof, 5, a.top, f"decode B={a.batch} C={a.context} (wall {wall * 1e3:.2f} ms/step under the profiler)")
    import cProfile
    import pstats

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        core.step()
    torch.cuda.synchronize()
    print(f"\n== decode wall without profilers: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms/step; host (cProfile):")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        core.step()
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
    pstats.Stats(pr).sort_stats("cumulative").print_stats(a.top)
    runner = core.executor.runner
    print("graphs:", None if runner.graphs is None else runner.graphs.sizes)
    live = sum(not s.finished for s in core.seqs.values())
    if live != a.batch:
        raise RuntimeError(f"only {live} of {a.batch} requests were still decoding: the profile is of a smaller batch")
    for rid in list(core.requests):
        core.abort_request(rid)
    core.step()
    if a.prefill:
        core.add_request("p", [rng.randrange(3, vocab) for _ in range(a.prefill)],
                         SamplingParams(temperature=0.0, max_tokens=1))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while core.has_unfinished():
                core.step()
            torch.cuda.synchronize()
        show(prof, 1, a.top, f"prefill {a.prefill}")


if __name__ == "__main__":
    main()
