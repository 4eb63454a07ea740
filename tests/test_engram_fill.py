"""Engram miss fill (v41.kernels.engram_fill, ../shared/docs/kernels.md §4): the PyTorch reference's semantics;
the UVA Triton kernel against it on the CPU through Triton's interpreter (this file run as a script in a subprocess
that sets ``TRITON_INTERPRET=1`` and ``V41_KERNELS=triton`` before importing v41, as tests/test_triton_interpreter.py
does, docs/numerics.md §4a); and on a GPU with a pinned host table (skipped without CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from v41.kernels.engram_fill import fill_slots, fill_slots_reference, fill_slots_uva

POISON = 0xAB


def case(g: torch.Generator, r: int, s: int, b: int, m: int, pad: int, device="cpu"):
    """A host table [r, b], a copy list of m entries (pad of them slot −1 with junk rows) to distinct slots, and
    slots [s, b] poisoned with 0xAB."""
    host = torch.randint(0, 256, (r, b), generator=g, dtype=torch.uint8)
    copy_slots = torch.randperm(s, generator=g)[:m]
    copy_rows = torch.randint(0, r, (m,), generator=g)
    padded = torch.randperm(m, generator=g)[:pad]
    copy_slots[padded] = -1
    copy_rows[padded] = torch.tensor([-1, r, 1 << 40, 3])[torch.arange(len(padded)) % 4]  # never read
    slots = torch.full((s, b), POISON, dtype=torch.uint8, device=device)
    return host, copy_rows.to(device), copy_slots.to(device), slots


def expected(host, copy_rows, copy_slots, s):
    want = torch.full((s, host.shape[1]), POISON, dtype=torch.uint8)
    for row, slot in zip(copy_rows.tolist(), copy_slots.tolist()):
        if slot >= 0:
            want[slot] = host[row]
    return want


@pytest.mark.parametrize("b", [33, 264])
@pytest.mark.parametrize("m,pad", [(0, 0), (1, 0), (9, 3), (40, 40), (64, 17)])
def test_reference_copies_live_entries_and_skips_padding(b, m, pad):
    g = torch.Generator().manual_seed(m * 1000 + b)
    host, rows, slots_idx, slots = case(g, 100, 70, b, m, pad)
    fill_slots_reference(host, rows, slots_idx, slots)
    assert torch.equal(slots, expected(host, rows, slots_idx, 70))


def test_reference_copies_one_row_to_several_slots():
    host = torch.arange(5 * 33, dtype=torch.int64).remainder(251).to(torch.uint8).view(5, 33)
    slots = torch.full((6, 33), POISON, dtype=torch.uint8)
    fill_slots_reference(host, torch.tensor([2, 2, 4, 2]), torch.tensor([0, 5, 3, -1]), slots)
    assert torch.equal(slots[0], host[2]) and torch.equal(slots[5], host[2]) and torch.equal(slots[3], host[4])
    assert (slots[[1, 2, 4]] == POISON).all()


def test_bad_operands_raise():
    host, slots = torch.zeros(10, 33, dtype=torch.uint8), torch.zeros(4, 33, dtype=torch.uint8)
    rows, idx = torch.tensor([1, 2]), torch.tensor([0, 1])
    bad = [(torch.zeros(10, 32, dtype=torch.uint8), rows, idx, slots),  # record widths differ
           (host.float(), rows, idx, slots),  # not uint8
           (host, rows, idx, slots.view(-1)),  # not 2-D
           (host, rows.int(), idx, slots),  # not int64
           (host, rows, idx[:1], slots),  # lengths differ
           (host, rows[:, None], idx[:, None], slots),  # not 1-D
           (host, torch.tensor([1, 10]), idx, slots),  # a live row out of range
           (host, rows, torch.tensor([0, 4]), slots)]  # a live slot out of range
    for args in bad:
        with pytest.raises(ValueError):
            fill_slots_reference(*args)
    with pytest.raises(ValueError):
        fill_slots(host, rows, idx, slots, transfer="dma")


def test_dispatch_on_cpu_runs_the_reference():
    g = torch.Generator().manual_seed(7)
    for transfer in ("uva", "copy"):
        host, rows, idx, slots = case(g, 50, 30, 264, 12, 4)
        fill_slots(host, rows, idx, slots, transfer=transfer)
        assert torch.equal(slots, expected(host, rows, idx, 30))


def interpreter_checks():
    """The kernel vs the reference (bitwise) under the interpreter: (name, error, tolerance) per case."""
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    out = []
    for b in (33, 264):
        for m in (0, 1, 5, int(torch.randint(2, 60, (1,), generator=g))):
            for programs in (None, 1, 3):
                pad = int(torch.randint(0, m + 1, (1,), generator=g))
                host, rows, idx, slots = case(g, 80, 64, b, m, pad)
                fill_slots_uva(host, rows, idx, slots, num_programs=programs)
                same = torch.equal(slots, expected(host, rows, idx, 64))
                out.append((f"uva/b{b}/m{m}/pad{pad}/p{programs}", 0.0 if same else float("inf"), 0.0))
    # records through a misaligned view (byte path although 264 % 4 == 0) and live entries out of range (skipped)
    wide = torch.randint(0, 256, (40, 265), generator=g, dtype=torch.uint8)
    host, slots = wide[:, 1:], torch.full((20, 264), POISON, dtype=torch.uint8)
    rows, idx = torch.tensor([3, 39, 40, -2, 7]), torch.tensor([0, 19, 5, 6, 20])
    fill_slots_uva(host, rows, idx, slots)
    want = expected(host, rows[:2], idx[:2], 20)
    out.append(("uva/misaligned-and-out-of-range", 0.0 if torch.equal(slots, want) else float("inf"), 0.0))
    return out


@pytest.mark.timeout(300)
def test_uva_kernel_equals_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", V41_KERNELS="triton", OMP_NUM_THREADS="1")
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env, cwd=here, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 25, proc.stdout + proc.stderr[-2000:]
    bad = [r for r in results if not r["err"] <= r["tol"]]
    assert not bad, bad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b", [33, 264])
def test_uva_kernel_on_gpu_reads_a_pinned_table(b):
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(b)
    for m, pad in ((0, 0), (1, 0), (300, 41), (5000, 1000)):
        host, rows, idx, slots = case(g, 20000, 6000, b, m, pad, device="cuda")
        host = host.pin_memory()
        want = slots.clone()
        fill_slots(host, rows, idx, slots, transfer="uva")
        fill_slots(host, rows, idx, want, transfer="copy")
        torch.cuda.synchronize()
        assert torch.equal(slots.cpu(), want.cpu())
        assert torch.equal(want.cpu(), expected(host, rows.cpu(), idx.cpu(), 6000))
    with pytest.raises(ValueError, match="pinned"):
        fill_slots_uva(torch.zeros(10, b, dtype=torch.uint8), rows[:1] % 10, idx[:1], slots)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uva_kernel_replays_in_a_cuda_graph():
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    host, rows, idx, slots = case(g, 5000, 512, 264, 128, 30, device="cuda")
    host = host.pin_memory()
    fill_slots_uva(host, rows, idx, slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fill_slots_uva(host, rows, idx, slots)
    for seed in range(3):  # new copy lists written into the captured buffers
        _, r2, i2, _ = case(torch.Generator().manual_seed(seed), 5000, 512, 264, 128, 50)
        rows.copy_(r2)
        idx.copy_(i2)
        slots.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(slots.cpu(), expected(host, r2, i2, 512))


if __name__ == "__main__":  # the interpreter run: one JSON line per check
    for name, err, limit in interpreter_checks():
        print(json.dumps({"name": name, "err": err, "tol": limit}))
    sys.stdout.flush()
