"""Tensor-parallel figures on a multi-GPU host (device tool; see tp_bench.sh for the whole call).

``probe``: what the backends rely on (GPU count, peer access, pinned registration, /dev/shm).
``allreduce``: latency of one all-reduce of [rows, hidden] bf16 per backend (eager loop, synchronised each
iteration; median and p90 over ``--iters``), W = ``--world`` ranks, each rank one process on cuda:rank.
``engine``: TP=W vs TP=1 greedy tokens and logprobs per backend on a checkpoint (or dummy weights), and the
end-to-end decode step time (scheduler + forward + sampling) at batch 1 and 8.
Every result is one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import sys
import time
import uuid

import torch


def _emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _allreduce_rank(rank: int, world: int, port: int, backend: str, rows: list[int], hidden: int, iters: int,
                    q) -> None:
    from v41.distributed.runtime import RankInfo, Runtime

    logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(name)s: %(message)s")
    info = RankInfo(rank=rank, world_size=world, local_rank=rank, nnodes=1, node_rank=0, master_addr="127.0.0.1",
                    master_port=port, device="cuda", session=f"bench{port}")
    rt = Runtime.start(info, backend)
    dev = torch.device("cuda", rank)
    out = []
    for m in rows:
        x = torch.randn(m, hidden, dtype=torch.bfloat16, device=dev)
        for _ in range(10):
            rt.group.all_reduce(x.clone())
        times = []
        for _ in range(iters):
            y = x.clone()
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            rt.group.all_reduce(y)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
        times.sort()
        out.append(dict(rows=m, bytes=m * hidden * 2, median_us=1e6 * statistics.median(times),
                        p90_us=1e6 * times[int(0.9 * len(times))]))
    if rank == 0:
        q.put(dict(backend_requested=backend, backend_used=rt.backend, reason=rt.reason, results=out))
    rt.close()


def cmd_allreduce(a) -> None:
    from v41.engine.executor import free_port

    ctx = mp.get_context("spawn")
    for backend in a.backends.split(","):
        q, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_allreduce_rank, args=(r, a.world, port, backend, a.rows, a.hidden, a.iters, q))
                 for r in range(a.world)]
        for p in procs:
            p.start()
        res = q.get(timeout=300)
        for p in procs:
            p.join(60)
        _emit(kind="allreduce", world=a.world, hidden=a.hidden, **res)


def _decode_step_ms(llm, batch: int, prompt_len: int, steps: int) -> float:
    from v41.engine.params import SamplingParams

    core = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"b{batch}-{uuid.uuid4().hex[:6]}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        core.add_request(rid, [0] + [(7 * i + j) % 900 + 3 for j in range(prompt_len - 1)], sp)
    produced: dict[str, int] = {}
    while len(produced) < batch or min(produced.values()) < 2:  # prefill done, one decode step taken
        for o in core.step():  # deltas: count each request's new tokens
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.outputs[0].token_ids)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t) / steps
    for rid in ids:
        core.abort_request(rid)
    return ms


def cmd_engine(a) -> None:
    from v41.engine.llm import LLM
    from v41.engine.params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, logprobs=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [[0] + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (4, 19, 63, 130)]
    kw = dict(device="cuda", load_format=a.load_format, block_size=a.block_size, max_num_seqs=16,
              num_kv_blocks=a.num_kv_blocks)
    runs = [(1, "nccl")] + [(a.tp, b) for b in a.backends.split(",")]
    base = None
    for tp, backend in runs:
        free, total = torch.cuda.mem_get_info(0)
        print(f"cuda:0 free {free / 2**30:.1f} of {total / 2**30:.1f} GiB before TP={tp} {backend}", file=sys.stderr)
        with LLM(a.model, tensor_parallel_size=tp, all_reduce_backend=backend, **kw) as llm:
            outs = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
            used = getattr(llm.engine.executor, "backend", "none (TP=1)")
            step_ms = {f"batch{b}": _decode_step_ms(llm, b, 64, a.steps) for b in (1, 8)}
        res = dict(kind="engine", model=a.model, tp=tp, backend_requested=backend, backend_used=used,
                   decode_step_ms=step_ms)
        if base is None:
            base = outs
        else:
            res["tokens_equal_tp1"] = [o.token_ids == b.token_ids for o, b in zip(outs, base)]
            res["max_logprob_diff"] = max(abs(lo[t].logprob - lb[t].logprob)
                                          for o, b in zip(outs, base) if o.token_ids == b.token_ids
                                          for lo, lb, t in zip(o.logprobs, b.logprobs, b.token_ids))
        _emit(**res)


def cmd_probe(a) -> None:
    from v41.distributed.probe import probe

    _emit(kind="probe", **probe())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("probe")
    ar = sub.add_parser("allreduce")
    ar.add_argument("--world", type=int, default=2)
    ar.add_argument("--backends", default="nccl,host,pcie-pull")
    ar.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64, 512, 4096])
    ar.add_argument("--hidden", type=int, default=5120)
    ar.add_argument("--iters", type=int, default=200)
    en = sub.add_parser("engine")
    en.add_argument("--model", required=True)
    en.add_argument("--load-format", default="auto")
    en.add_argument("--tp", type=int, default=2)
    en.add_argument("--backends", default="nccl,host,pcie-pull")
    en.add_argument("--block-size", type=int, default=None)
    en.add_argument("--max-tokens", type=int, default=16)
    en.add_argument("--steps", type=int, default=16)
    en.add_argument("--num-kv-blocks", type=int, default=256)
    a = p.parse_args()
    {"probe": cmd_probe, "allreduce": cmd_allreduce, "engine": cmd_engine}[a.cmd](a)


if __name__ == "__main__":
    main()
