"""DSpark speculation on the GPU with the embedded tiny V4.1 (issue 15): greedy speculative tokens against the plain
engine's (margin rule, docs/numerics.md §4), then decode throughput with and without speculation.

    python benches/gpu/spec_check.py [--tokens 128] [--batches 1 8] [--ks 1 3 5] > $OUT/spec.txt

Checks first (exit status 1 on a mismatch), then one table: batch, K, tokens/s plain and speculative, their ratio,
acceptance (pooled over draft tokens) and mean acceptance length (docs/speculative-decoding.md §4). Plain decode
replays CUDA graphs; verify steps run eager (not captured yet), so the ratio is what speculation buys today.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from v41.engine.llm import LLM
from v41.engine.params import SamplingParams

PROMPTS = ["def main(args):\n    ", "import os\nimport sys\n\n", "The scheduler plans one step", "class Foo:\n",
           "for i in range(", "# Licensed under", "return self.", "if __name__ =="]
MARGIN = 2e-4


def run(llm: LLM, prompts: list[str], tokens: int, logprobs: int | None = None):
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=logprobs)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    return outs, time.perf_counter() - t


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
    a = ap.parse_args()
    kw = dict(device="cuda", max_num_seqs=max(a.batches))
    plain = LLM(None, gpu_memory_utilization=0.05, **kw)  # the speculative engine's budget counts this one's
    rows, bad = [], 0
    for b in a.batches:
        prompts = (PROMPTS * b)[:b]
        ref, t_plain = run(plain, prompts, a.tokens, logprobs=2)
        for k in a.ks:
            spec = LLM(None, speculative_config={"num_speculative_tokens": k}, gpu_memory_utilization=0.1, **kw)
            outs, t_spec = run(spec, prompts, a.tokens)
            for o, r in zip(outs, ref):
                got, want = o.outputs[0].token_ids, r.outputs[0].token_ids
                n = first_tie(r.outputs[0])
                if list(got[:n]) != list(want[:n]):
                    bad += 1
                    print(f"MISMATCH batch {b} K {k}: {list(got[:n])} vs {list(want[:n])}", file=sys.stderr)
            drafted = sum(o.outputs[0].spec_decode.num_draft_tokens for o in outs)
            accepted = sum(o.outputs[0].spec_decode.num_accepted_tokens for o in outs)
            drafts = sum(o.outputs[0].spec_decode.num_drafts for o in outs)
            rows.append((b, k, b * a.tokens / t_plain, b * a.tokens / t_spec, t_plain / t_spec,
                         accepted / max(1, drafted), 1 + accepted / max(1, drafts)))
            spec.shutdown()
            del spec
            torch.cuda.empty_cache()
    print(f"checks: {'all speculative tokens equal the plain ones' if not bad else f'{bad} MISMATCHES'}")
    print(f"{'batch':>5} {'K':>2} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'accept':>7} {'mean len':>8}")
    for b, k, tp, ts, r, acc, mal in rows:
        print(f"{b:>5} {k:>2} {tp:>12.1f} {ts:>11.1f} {r:>6.2f} {acc:>7.3f} {mal:>8.2f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
