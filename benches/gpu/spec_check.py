"""DSpark speculation on the GPU with the embedded tiny V4.1 (issue 15): greedy speculative tokens against the plain
engine's (margin rule, docs/numerics.md §4), then decode throughput with and without speculation.

    python benches/gpu/spec_check.py [--tokens 128] [--batches 1 8] [--ks 1 3 5] [--eager-k 5] [--adaptive-k 5]
        [--repeats 3] [--profile F]
        [--model DIR --load-format dummy --mem 0.3 0.6] [--dtype float32]

Checks first (exit status 1 on a mismatch), then one table: batch, K, mode, tokens/s plain and speculative, their
ratio, acceptance (pooled over draft tokens) and mean acceptance length (docs/speculative-decoding.md §5). Plain
decode replays CUDA graphs; speculation replays verify graphs (1 + K rows per request) and draft graphs, and with
``--eager-k`` also runs that K eagerly (``enforce_eager``) for comparison, with ``--adaptive-k`` with adaptive
verification (a graph set per query-token count; its start-up cost profile is printed). ``--profile F`` writes a cProfile of the
batch-1 speculative run at the largest K (top functions by own time) to F. With ``--model`` and random weights
(``--load-format dummy``, e.g. v41-mid from ``make_models.py``) the drafter is never right: each speculative step
commits one token, so the ratio is the cost of a plain decode step over a speculative one (verify 1 + K rows, draft
pass, verification) at that model size, and a drafter with mean acceptance length L would give L times it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

from v41.engine.llm import LLM
from v41.engine.params import SamplingParams

PROMPTS = ["def main(args):\n    ", "import os\nimport sys\n\n", "The scheduler plans one step", "class Foo:\n",
           "for i in range(", "# Licensed under", "return self.", "if __name__ =="]
MARGIN = 2e-4


def run(llm: LLM, prompts: list[str], tokens: int, logprobs: int | None = None, repeats: int = 1):
    """Outputs and the median seconds of ``repeats`` timed generations (after a warm-up)."""
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=logprobs)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return outs, sorted(times)[len(times) // 2]


def first_tie(out) -> int:
    """The first position whose plain top-2 logprob margin is below MARGIN (len if none)."""
    for i, lp in enumerate(out.logprobs):
        top = sorted((v.logprob for v in lp.values()), reverse=True)
        if len(top) > 1 and top[0] - top[1] < MARGIN:
            return i
    return len(out.token_ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--eager-k", type=int, nargs="*", default=[])
    ap.add_argument("--adaptive-k", type=int, nargs="*", default=[])
    ap.add_argument("--repeats", type=int, default=1, help="timed generations per cell (median)")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights (a config-only checkpoint)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--mem", type=float, nargs=2, default=[0.05, 0.1], help="gpu_memory_utilization plain, spec")
    a = ap.parse_args()
    kw = dict(device="cuda", max_num_seqs=max(a.batches), load_format=a.load_format, dtype=a.dtype)
    plain = LLM(a.model, gpu_memory_utilization=a.mem[0], **kw)  # the speculative engine's budget counts it
    rows, bad = [], 0
    for b in a.batches:
        prompts = (PROMPTS * b)[:b]
        ref, _ = run(plain, prompts, a.tokens, logprobs=2)  # the check's reference (logprobs cost host time)
        _, t_plain = run(plain, prompts, a.tokens, repeats=a.repeats)
        runs = [(k, "graphs") for k in a.ks] + [(k, "eager") for k in a.eager_k] + [(k, "adapt") for k in a.adaptive_k]
        for k, mode in runs:
            spec = LLM(a.model, speculative_config={"num_speculative_tokens": k,
                                                    "enable_adaptive_verification": mode == "adapt"},
                       gpu_memory_utilization=a.mem[1], enforce_eager=mode == "eager", **kw)
            if mode == "adapt":
                print(f"batch {b} K {k} adaptive: verify-cost profile\n{spec.engine.executor.runner.verify_costs.table()}")
            prof = cProfile.Profile() if a.profile and b == 1 and k == max(a.ks) and mode == "graphs" else None
            if prof is not None:
                prof.enable()
            outs, t_spec = run(spec, prompts, a.tokens, repeats=a.repeats)
            if prof is not None:
                prof.disable()
                with open(a.profile, "w") as f:
                    pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
            for o, r in zip(outs, ref):
                got, want = o.outputs[0].token_ids, r.outputs[0].token_ids
                n = first_tie(r.outputs[0])
                if list(got[:n]) != list(want[:n]):
                    bad += 1
                    print(f"MISMATCH batch {b} K {k}: {list(got[:n])} vs {list(want[:n])}", file=sys.stderr)
            drafted = sum(o.outputs[0].spec_decode.num_draft_tokens for o in outs)
            accepted = sum(o.outputs[0].spec_decode.num_accepted_tokens for o in outs)
            drafts = sum(o.outputs[0].spec_decode.num_drafts for o in outs)
            rows.append((b, k, mode, b * a.tokens / t_plain, b * a.tokens / t_spec,
                         t_plain / t_spec, accepted / max(1, drafted), 1 + accepted / max(1, drafts)))
            spec.shutdown()
            del spec
            torch.cuda.empty_cache()
    print(f"checks: {'all speculative tokens equal the plain ones' if not bad else f'{bad} MISMATCHES'}")
    print(f"{'batch':>5} {'K':>2} {'mode':>6} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'accept':>7} "
          f"{'mean len':>8}")
    for b, k, mode, tp, ts, r, acc, mal in rows:
        print(f"{b:>5} {k:>2} {mode:>6} {tp:>12.1f} {ts:>11.1f} {r:>6.2f} {acc:>7.3f} {mal:>8.2f}")
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())
