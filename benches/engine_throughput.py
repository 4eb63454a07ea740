"""Offline engine throughput in the style of nano-vllm's bench.py.

256 requests (configurable), random input lengths in [100, 1024] and output lengths in [100, 1024] tokens,
ignore_eos, all submitted at once. Prints output tokens per second, the mean scheduler time per step and the
share of the step spent outside the model forward. Random weights: the tokens are meaningless.

    python benches/engine_throughput.py                       # tiny model on CPU (small default sizes)
    python benches/engine_throughput.py --num-requests 256 --max-input 1024 --max-output 1024 --device cuda \
        --model DIR
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the embedded tiny V4.1 model)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="compute dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    args = ap.parse_args()

    import torch

    from v41 import LLM, SamplingParams

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              device=args.device, dtype=args.dtype, max_model_len=args.max_input + args.max_output + 1,
              load_format=args.load_format)
    vocab = llm.engine.cfg.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(args.min_output, args.max_output))
              for _ in prompts]
    llm.generate([[0, 5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    core = llm.engine
    sched_s = model_s = 0.0
    steps = 0
    orig_exec = core.executor.runner.execute

    class TimedScheduler:
        """Forwards to the native scheduler, timing step()."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __contains__(self, sid):
            return sid in self.inner

        def step(self):
            nonlocal sched_s
            t = time.perf_counter()
            out = self.inner.step()
            sched_s += time.perf_counter() - t
            return out

    def timed_exec(*a, **k):
        nonlocal model_s, steps
        t = time.perf_counter()
        out = orig_exec(*a, **k)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        model_s += time.perf_counter() - t
        steps += 1
        return out

    core.scheduler, core.executor.runner.execute = TimedScheduler(core.scheduler), timed_exec
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"requests={len(outs)} input_tokens={sum(map(len, prompts))} output_tokens={n_out}")
    print(f"wall={wall:.2f}s output_tok/s={n_out / wall:.1f} steps={steps}")
    print(f"scheduler_us_per_step={1e6 * sched_s / max(1, steps):.1f} "
          f"outside_model_share={(wall - model_s) / wall:.3f}")


if __name__ == "__main__":
    main()
