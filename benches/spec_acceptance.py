"""DSpark acceptance in the engine, on the CPU (issue 15 benchmark): the embedded model and its trained drafter
serving held-out prompts with speculation at K = 1..K_max, greedy and at temperature 0.7 with token-wise and block
verification, and with adaptive verification.

    python benches/spec_acceptance.py [--prompts 16] [--tokens 128] [--ks 1 2 3 4 5] [--threads 2]

Per configuration: one engine (fast model, CPU, ``max_num_seqs`` = prompts), every held-out prompt (64 tokens,
``v41.testing.acceptance.heldout_prompts``) generating ``tokens`` tokens with EOS ignored, seeded. Reported as
docs/speculative-decoding.md §5 defines them, from the completions' ``SpecDecodeStats`` summed: acceptance per
position (accepted_i / verified_i), pooled acceptance (accepted / draft tokens) and the mean acceptance length
(1 + accepted / verify steps). The first token of each request comes from its prefill and is not counted.
Unlike ``python -m v41.testing.acceptance`` (the reference model, token-wise only), this is the serving path: the
fast model's drafts, the engine's keyed draws and its verifiers.
"""

from __future__ import annotations

import argparse
import time

import torch

from v41.config import load_config
from v41.engine.llm import LLM
from v41.engine.params import SamplingParams
from v41.engine.spec_stats import SpecDecodeStats
from v41.testing.acceptance import heldout_prompts
from v41.testing.embedded import embedded_model_dir


def measure(prompts: list[list[int]], tokens: int, spec: dict, temperature: float) -> tuple[SpecDecodeStats, float]:
    llm = LLM(None, device="cpu", max_num_seqs=len(prompts), speculative_config=spec)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=tokens, ignore_eos=True)
              for i in range(len(prompts))]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    total = SpecDecodeStats.empty(spec["num_speculative_tokens"])
    for o in outs:
        total.merge(o.outputs[0].spec_decode)
    llm.engine.shutdown()
    return total, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = embedded_model_dir()
    eos = load_config(model).eos_token_ids[0]
    prompts = [p.tolist() for p in heldout_prompts(model, eos, 64, a.prompts)]
    runs = [(k, 0.0, "greedy", False) for k in a.ks] + [(k, 0.7, m, False) for k in a.ks for m in ("token", "block")]
    runs += [(max(a.ks), 0.0, "greedy", True), (max(a.ks), 0.7, "block", True)]
    rows = []
    for k, temp, method, adaptive in runs:
        spec = {"num_speculative_tokens": k, "rejection_sample_method": method,
                "enable_adaptive_verification": adaptive}
        stats, seconds = measure(prompts, a.tokens, spec, temp)
        per_pos = [acc / max(1, ver) for acc, ver in zip(stats.accepted_per_position, stats.verified_per_position)]
        rows.append((k, temp, method + (" adaptive" if adaptive else ""), per_pos, stats.acceptance_rate,
                     stats.mean_acceptance_length, stats.num_draft_tokens, seconds))
        print(rows[-1], flush=True)
    print(f"\nembedded model, {a.prompts} held-out prompts x {a.tokens} tokens, CPU ({a.threads} threads)")
    print(f"{'K':>2} {'T':>4} {'verification':<16} {'per position':<36} {'pooled':>7} {'mean len':>8} "
          f"{'drafts':>7} {'s':>6}")
    for k, temp, method, per_pos, pooled, mean_len, drafted, seconds in rows:
        pp = " ".join(f"{x:.3f}" for x in per_pos)
        print(f"{k:>2} {temp:>4.1f} {method:<16} {pp:<36} {pooled:>7.3f} {mean_len:>8.3f} {drafted:>7d} {seconds:>6.1f}")


if __name__ == "__main__":
    main()
