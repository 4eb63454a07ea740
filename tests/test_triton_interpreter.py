"""Every Triton kernel of ``v41.kernels`` equals its PyTorch reference when run on the CPU by Triton's interpreter
(docs/numerics.md §4a): each check runs in a subprocess that sets ``TRITON_INTERPRET=1`` and ``V41_KERNELS=triton``
before importing v41 (float32 operands, small grids; inputs drawn fresh each run, see ``kernel_checks.py``). Every
launch the check made is then compiled for sm_90a by Triton's compiler (``triton_launches.py``: the interpreter
accepts kernels the compiler rejects)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_checks import CHECKS

pytest.importorskip("triton")
HERE = Path(__file__).parent


@pytest.mark.timeout(600)
@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_triton_kernel_equals_its_reference_in_the_interpreter_and_compiles_for_sm90(check, tmp_path):
    launches = tmp_path / "launches.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1", V41_KERNELS="triton", OMP_NUM_THREADS="1",
               V41_RECORD_LAUNCHES=str(launches))
    proc = subprocess.run([sys.executable, str(HERE / "kernel_checks.py"), check], env=env, cwd=HERE,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert results, proc.stdout + proc.stderr[-2000:]
    bad = [r for r in results if not r["err"] <= r["tol"]]
    assert not bad, bad
    assert launches.exists(), "the check launched no Triton kernel"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "V41_KERNELS")}
    proc = subprocess.run([sys.executable, str(HERE / "triton_launches.py"), str(launches)], env=env, cwd=HERE,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
