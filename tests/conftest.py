"""Test-session hooks: one intra-op thread per test process, and the matrix cells that ``make test`` (CI: 2 cores,
about 30 minutes, docs/numerics.md §4a) leaves to ``make test-all``.

A module-level fixture parametrized by architecture cannot take a ``slow`` mark per parameter in the test file,
so those cells are named here; each entry says what CI still runs in its place. Seconds are test time on the
2-core machine (``--durations``, 2026-12-02).
"""

from __future__ import annotations

import os
from pathlib import Path

# One intra-op thread per test process (and the subprocesses it starts): the tiny tensors of the tests gain
# nothing from more, and two ``-n 2`` workers on 2 cores running torch's default 2 threads each made a sample of
# engine tests 2.7× slower (130.7 s against 47.7 s, measured 2026-12-03).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

CI_SLOW = {
    "test_engine.py::test_concurrent_requests_get_the_tokens_they_get_alone[deepseek_v4]": "111 s; V4.1 in CI",
    "test_engine.py::test_preemption_and_resume_give_identical_tokens[deepseek_v4]": "51 s; V4.1 in CI",
    "test_engine.py::test_prefix_cache_hit_equals_cold_run[deepseek_v4-16]": "50 s; V4 at 33 and V4.1 at 16 in CI",
    "test_engine.py::test_prefix_cache_hit_equals_cold_run[deepseek_v41-33]": "29 s; as above",
    "test_engine.py::test_chunked_prefill_gives_the_same_tokens_and_logprobs[deepseek_v4-1]": "31 s; V4 chunk 2 in CI",
    "test_adaptive_verify.py::test_adaptive_greedy_speculation_gives_the_oracles_tokens_with_the_measured_profile":
        "109 s; the shorter-prefix run and the lossless checks of adaptive verification in CI",
    "test_step_models.py::test_mixed_batch_of_prefills_and_decodes_equals_each_request_alone[deepseek_v41-paged]":
        "51 s; the fast model's cells and the paged chunk test in CI",
    "test_step_models.py::test_mixed_batch_of_prefills_and_decodes_equals_each_request_alone[deepseek_v4-paged]":
        "19 s; as above",
    "test_tp_model.py::test_tp_logits_equal_tp1_on_every_rank[deepseek_v41-4]": "40 s; TP=2 here, TP=4 engines in CI",
    "test_tp_model.py::test_tp_logits_equal_tp1_on_every_rank[deepseek_v4-4]": "26 s; as above",
    "test_tp_engine.py::test_tp_gives_tp1_tokens_and_logprobs[deepseek_v41-4-gloo]": "26 s; TP=4 host in CI",
    "test_tp_engine.py::test_tp_engines_dropped_without_shutdown_release_their_workers_one_after_another"
    "[deepseek_v41]": "48 s; V4 in CI",
}


@pytest.hookimpl(tryfirst=True)  # before ``-m "not slow"`` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if f"{Path(str(item.path)).name}::{item.name}" in CI_SLOW:
            item.add_marker(pytest.mark.slow)
