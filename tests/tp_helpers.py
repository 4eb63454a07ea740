"""Helpers of the tensor-parallel tests: run a function on W spawned gloo ranks (one torch thread each, killed
on failure or timeout), and one workload (reference forward, paged engine steps, DSpark draft) that TP=1 and
every TP rank run identically so their logits can be compared (docs/numerics.md §4: TP=N vs TP=1)."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from pathlib import Path

import torch

from engine_helpers import StepDriver
from v41.distributed.group import TPGroup

SPAWN_TIMEOUT_S = 240.0  # CI: 2 loaded cores run W ranks plus another pytest worker


class FakeGroup(TPGroup):
    """A group that only claims a rank (no collectives): for building / loading one rank's shard in-process."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.name = rank, world_size, "fake"

    def all_reduce(self, x):
        raise RuntimeError("FakeGroup has no collectives")

    all_gather = all_reduce


def _rank_entry(rank: int, world_size: int, tmp: str, fn, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(tmp) / f"rank{rank}"
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world_size)
        from v41.distributed.torch_backend import TorchDistGroup

        group = TorchDistGroup()
        result = fn(group, *args)
        group.barrier()
        torch.save(result, str(out) + ".pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(str(out) + ".err")).write_text(traceback.format_exc())
        raise SystemExit(1)


def spawn_ranks(world_size: int, tmp: Path, fn, *args, timeout_s: float = SPAWN_TIMEOUT_S) -> list:
    """Run ``fn(group, *args)`` on ``world_size`` spawned processes joined by gloo; returns every rank's result
    (``torch.save``-able), in rank order. Kills every process still alive on failure or after ``timeout_s``."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_entry, args=(r, world_size, str(tmp), fn, args), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a rank failed: the others may wait forever in a collective
            time.sleep(0.05)
        errors = [(tmp / f"rank{r}.err").read_text() for r in range(world_size) if (tmp / f"rank{r}.err").exists()]
        if errors:
            raise AssertionError("TP rank failed:\n" + "\n".join(errors))
        if any(p.exitcode != 0 for p in procs):
            raise AssertionError(f"TP ranks did not finish in {timeout_s} s (exit codes "
                                 f"{[p.exitcode for p in procs]})")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world_size)]


# -------------------------------------------------------------------------------------------------------------
# the workload
# -------------------------------------------------------------------------------------------------------------


def workload(model, prompts: list[list[int]], decode: list[list[int]], fast=None) -> dict[str, torch.Tensor]:
    """Logits of (a) the reference whole-sequence forward of ``prompts`` [B, T]; (b) the paged bridge over the
    reference ``model`` and (c) the fast model ``fast`` (when given): one prefill step of all prompts, then one
    decode step per column of ``decode`` (teacher-forced tokens); (d) with DSpark, a draft block after prompt 0
    (anchor ``decode[0][0]``)."""
    from v41.models.paged import PagedModel

    out = {"forward": model(torch.tensor(prompts))}
    for label, step_model in (("paged", PagedModel(model, 4096)), ("fast", fast)):
        if step_model is None:
            continue
        drv = StepDriver(step_model, model.hasher, block_tokens=16, max_blocks=8, n_slots=2)
        seqs = [list(p) for p in prompts]
        steps = [drv.execute([(s, p, 0, []) for s, p in enumerate(prompts)])]
        for k in range(len(decode[0])):
            steps.append(drv.execute([(s, [decode[s][k]], len(seqs[s]), seqs[s]) for s in range(len(prompts))]))
            for s in range(len(prompts)):
                seqs[s].append(decode[s][k])
        out[label] = torch.cat(steps)
    if model.mtp is not None:
        c = model.new_cache()
        model.forward_chunk(torch.tensor(prompts[0]), c)
        d = model.draft(c, decode[0][0])
        out["draft_logits"], out["draft_confidence"] = d.logits, d.confidence
    return out


def tp_worker(group, runs: list[tuple[str, str, str, str]], prompts, decode) -> dict[str, dict]:
    """Per rank: for each (label, checkpoint dir, load_format, numerics), load this rank's shard (reference and,
    for exact numerics from a checkpoint, the fast model in float32) and run :func:`workload`."""
    from v41.models.fast import load_fast
    from v41.models.reference import load

    out = {}
    for label, path, fmt, numerics in runs:
        fast = load_fast(path, torch.float32, "cpu", tp=group) if numerics == "exact" and fmt == "auto" else None
        out[label] = workload(load(path, load_format=fmt, numerics=numerics, tp=group), prompts, decode, fast)
    return out


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max over positions of ‖a − b‖₂ / ‖b‖₂ along the last dim (docs/numerics.md §4)."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
