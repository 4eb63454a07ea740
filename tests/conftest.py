"""Test-session set-up (docs/numerics.md §4a): one intra-op thread per test process and the processes it starts.
The tiny tensors of the tests gain nothing from more, and two ``-n 2`` workers on 2 cores running torch's default
2 threads each made a sample of engine tests 2.7× slower (130.7 s against 47.7 s, measured 2026-12-03)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
