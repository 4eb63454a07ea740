"""Host time of an engine decode step outside the model: the tiny V4.1 engine on the CPU with B requests decoding,
the forward replaced by stored logits, so what is timed is the Python / Rust host path (scheduling, the step's
host plan, sampling on the CPU, committing and detokenizing tokens, building the outputs). Prints the median step
and the mean of each part (its method wrapped in a timer): ``_launch`` (the plan's host step, the executor call and
the sampler, itself shown apart), ``_complete`` (committing the sampled ids), ``_read_out`` (text and outputs).

    python benches/host_step.py [--batch 64] [--steps 200]

The sampler's share is CPU arithmetic here (on a GPU it is kernels); the other parts are what the GPU waits for in
a synchronous step (benches/RESULTS.md "2026-12-03 (ring and CUDA scorer)").
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from v41.engine.args import EngineArgs
from v41.engine.core import EngineCore
from v41.engine.params import SamplingParams
from v41.testing.tiny import make_tiny

PARTS = ("_launch", "sampler", "_complete", "_read_out")  # sampler: inside _launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    path = make_tiny(tempfile.mkdtemp(), "deepseek_v41")
    core = EngineCore(EngineArgs(model=str(path), device="cpu", max_num_seqs=a.batch, max_num_batched_tokens=4096,
                                 max_model_len=a.steps + 256, enable_prefix_caching=False))
    rng = random.Random(0)
    for i in range(a.batch):
        core.add_request(f"r{i}", [rng.randrange(3, 1000) for _ in range(32)],
                         SamplingParams(temperature=1.0, seed=i, ignore_eos=True, max_tokens=a.steps + 64))
    while any(len(s.output_token_ids) == 0 for s in core.seqs.values()):
        core.step()
    logits = torch.randn(a.batch, core.cfg.vocab_size)
    core.executor.execute = lambda step, pending=None: logits[: len(step.logits_rows)]
    spent = dict.fromkeys(PARTS, 0.0)
    for name in PARTS:
        def timed(*args, _f=getattr(core, name), _n=name, **kw):
            t = time.perf_counter()
            out = _f(*args, **kw)
            spent[_n] += time.perf_counter() - t
            return out
        setattr(core, name, timed)
    for _ in range(20):
        core.step()
    spent.update(dict.fromkeys(PARTS, 0.0))
    steps = []
    for _ in range(a.steps):
        t = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - t)
    print(f"B={a.batch}: host step median {statistics.median(steps) * 1e3:.2f} ms; mean per step: "
          + ", ".join(f"{k} {v / a.steps * 1e3:.2f} ms" for k, v in spent.items()))


if __name__ == "__main__":
    main()
