"""Host time of an engine decode step outside the model: a tiny engine on the CPU with B requests decoding, the
forward replaced by stored logits (their largest entries spell README.md's tokens), so what is timed is the Python
/ Rust host path (scheduling, the step's host plan, sampling on the CPU, committing and detokenizing tokens,
building the outputs). Prints the median step and the mean of each part (its method wrapped in a timer):
``_launch`` (the plan's host step, the executor call and the sampler, itself shown apart), ``_complete``
(committing the sampled ids), ``_read_out`` (text and outputs).

    python benches/host_step.py [--arch deepseek_v41] [--batch 64] [--steps 200] [--graph] [--greedy]

``--graph``: the path a GPU decode step takes: the executor packs the step into a CUDA graph's static inputs
(:mod:`v41.engine.graph_inputs`, shown apart as ``fill``) and "replays" it, the replay (the block-table prologue
and the forward, device work inside the graph on a GPU) replaced by the stored logits; async scheduling's pending
ids are resolved as on a GPU. Without it the executor call itself is replaced. ``--greedy``: temperature 0 (the
sampler is one argmax; at temperature 1 it is the CPU reference of the keyed sampling kernels, CPU arithmetic that
a GPU does in kernels). The other parts are what the GPU waits for when the host is slower than the step
(benches/RESULTS.md "2026-12-03 (ring and CUDA scorer)", "2026-12-05 (host path)").
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from v41.engine.args import EngineArgs
from v41.engine.core import EngineCore
from v41.engine.params import SamplingParams
from v41.testing.tiny import make_tiny

README = Path(__file__).resolve().parents[1] / "README.md"

PARTS = ("_launch", "sampler", "fill", "_complete", "_read_out")  # sampler and fill: inside _launch
CYCLE = 16  # stored logits per batch size, used in turn


def stub_forward(core: EngineCore, graph: bool) -> dict:
    """Replace the model by stored logits (module docstring); returns {part: object whose method to time}. Each row's
    largest logit walks through the tokens of README.md (a different place per row, the next token each step, in a
    cycle of :data:`CYCLE` stored tensors), so greedy decoding writes text, as a model does, and the detokenizer sees
    text, not one random id repeated (a byte that never completes a character holds every later id back)."""
    vocab = core.cfg.vocab_size
    text = [t for t in core.tokenizer.encode(README.read_text(encoding="utf-8")).ids if t < vocab]
    logits: dict[int, list[torch.Tensor]] = {}
    turn = [0]
    gen = torch.Generator().manual_seed(0)

    def stored(rows: int) -> torch.Tensor:
        if rows not in logits:
            base = torch.randn(rows, vocab, generator=gen)
            logits[rows] = []
            for c in range(CYCLE):
                x = base.clone()
                x[torch.arange(rows), [text[(997 * r + c) % len(text)] for r in range(rows)]] = 100.0
                logits[rows].append(x)
        turn[0] += 1
        return logits[rows][turn[0] % CYCLE]

    runner = core.executor.runner
    if not graph:
        core.executor.execute = lambda step, pending=None: stored(len(step.logits_rows))
        return {}
    graphs = runner.graphs = runner.make_graphs(runner._sizes(1), 1, capture=False)
    graphs._replay = lambda size: stored(size)
    return {f"fill:{size}": inputs for size, inputs in graphs.inputs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="deepseek_v41", choices=("deepseek_v41", "deepseek_v4"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--graph", action="store_true", help="pack CUDA-graph static inputs as a GPU step does")
    ap.add_argument("--greedy", action="store_true", help="temperature 0 (one argmax) instead of 1")
    a = ap.parse_args()
    torch.set_num_threads(1)
    path = make_tiny(tempfile.mkdtemp(), a.arch)
    core = EngineCore(EngineArgs(model=str(path), device="cpu", max_num_seqs=a.batch, max_num_batched_tokens=4096,
                                 max_model_len=a.steps + 256, enable_prefix_caching=False))
    rng = random.Random(0)
    for i in range(a.batch):
        core.add_request(f"r{i}", [rng.randrange(3, 1000) for _ in range(32)],
                         SamplingParams(temperature=0.0 if a.greedy else 1.0, seed=i, ignore_eos=True,
                                        max_tokens=a.steps + 64))
    while any(len(s.output_token_ids) == 0 for s in core.seqs.values()):
        core.step()
    fills = stub_forward(core, a.graph)
    spent = dict.fromkeys(PARTS, 0.0)
    targets = [(name, core, name) for name in ("_launch", "_complete", "_read_out")] + [("sampler", core, "sampler")]
    targets += [("fill", inputs, "fill") for inputs in fills.values()]
    for part, owner, attr in targets:
        def timed(*args, _f=getattr(owner, attr), _n=part, **kw):
            t = time.perf_counter()
            out = _f(*args, **kw)
            spent[_n] += time.perf_counter() - t
            return out
        setattr(owner, attr, timed)
    for _ in range(20):
        core.step()
    spent.update(dict.fromkeys(PARTS, 0.0))
    steps = []
    for _ in range(a.steps):
        t = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - t)
    shown = [k for k in PARTS if k != "fill" or a.graph]
    print(f"{a.arch} B={a.batch}{' graph' if a.graph else ''}{' greedy' if a.greedy else ''}: host step median "
          f"{statistics.median(steps) * 1e3:.3f} ms; mean per step: "
          + ", ".join(f"{k} {spent[k] / a.steps * 1e3:.3f} ms" for k in shown))


if __name__ == "__main__":
    main()
