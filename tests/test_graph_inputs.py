"""The static inputs of CUDA graphs, run eagerly on the CPU (engine/graph_inputs.py, engine/cuda_graph.py): steps
packed into a graph's padded region of ``size`` requests × ``q`` rows (padding requests, padding rows inside a
request, unused compressor segments, a subset of logits rows) give the eager step's logits and leave the same
cache behind. Verify steps of speculative decoding (1 + K rows per request) are such steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from v41.engine.args import EngineArgs
from v41.engine.graph_inputs import segment_shape
from v41.engine.model_runner import ModelRunner, graph_sizes
from v41.models.engram_loader import engram_hasher
from v41.testing.tiny import make_tiny

from engine_helpers import host_step

MAX_BLOCKS, BLOCK = 8, 16


def runners(path, spec: dict | None):
    out = []
    for _ in range(2):
        args = EngineArgs(model=str(path), device="cpu", dtype="float32", max_num_seqs=4, speculative_config=spec)
        runner = ModelRunner(args, "cpu")
        runner.init_cache(num_blocks=4 * MAX_BLOCKS, num_state_rows=4, block_tokens=BLOCK,
                          max_model_len=MAX_BLOCKS * BLOCK)
        out.append(runner)
    return out


def assert_same_cache(a, b) -> None:
    """Every cache row and state row but the padding ones."""
    for kind, layers in a.model.cache.tensors.items():
        dummy = a.model.cache.dummy_slot(kind)
        for lid, t in layers.items():
            torch.testing.assert_close(t[:dummy], b.model.cache.tensors[kind][lid][:dummy], rtol=1e-5, atol=1e-5)
    for lid, t in a.model.cache.state.items():
        n = a.model.cache.num_state_rows
        torch.testing.assert_close(t[:n], b.model.cache.state[lid][:n], rtol=1e-5, atol=1e-5)


def test_segment_shape_covers_every_start():
    assert segment_shape(4, 1) == (1, 1)
    for r in (2, 4, 128):
        for q in range(2, 9):
            n, w = segment_shape(r, q)
            for p in range(3 * r):
                windows = {x // r for x in range(p, p + q)}
                assert len(windows) <= n and w == min(r, q)
    assert graph_sizes(512, 64, 1)[-1] == 64 and graph_sizes(512, 256, 6)[-1] == 64 and graph_sizes(4, 8, 6) == [1]


@pytest.mark.parametrize("arch,spec", [("deepseek_v41", {"num_speculative_tokens": 3}), ("deepseek_v4", None)])
def test_padded_graph_inputs_give_the_eager_steps_logits_and_cache(tmp_path, arch, spec):
    path = make_tiny(tmp_path / arch, arch)
    eager, graphed = runners(path, spec)
    q = 4
    graphed.graphs = graphed.make_graphs([2, 4], q, capture=False)
    layout = eager.cache_layout(BLOCK)
    hasher = engram_hasher(eager.cfg, path / "tokenizer.json")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, n).tolist() for n in (13, 7, 22)]
    prefill = host_step(layout, [(s, p, 0, []) for s, p in enumerate(prompts)], MAX_BLOCKS, False, hasher)
    assert not graphed.graphs.fits(prefill)
    for run in (eager, graphed):
        run.execute(prefill)
    # (slots in the step, tokens per request, logits for every row?): padding requests, rows and segments
    plans = [((0, 1, 2), (4, 1, 3), True), ((0, 2), (2, 4), True), ((0, 1, 2), (4, 4, 4), True),
             ((1,), (3,), False), ((0, 1, 2), (1, 1, 1), False), ((2, 0, 1), (4, 3, 4), True)]
    for slots, counts, all_rows in plans:
        runs = []
        for s, n in zip(slots, counts):
            toks = rng.integers(3, 200, n).tolist()
            runs.append((s, toks, len(prompts[s]), list(prompts[s])))
            prompts[s] += toks
        step = host_step(layout, runs, MAX_BLOCKS, all_rows, hasher, send_tables=False)
        assert graphed.graphs.fits(step)
        want, got = eager.execute(step), graphed.execute(step)
        assert got.shape == want.shape == (step.logits_rows.size, eager.cfg.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert_same_cache(eager, graphed)
    too_long = host_step(layout, [(0, [5] * (q + 1), len(prompts[0]), prompts[0])], MAX_BLOCKS, True, hasher,
                         send_tables=False)
    assert not graphed.graphs.fits(too_long)
