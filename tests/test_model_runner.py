"""The paged model runner reproduces the reference model (DESIGN.md §4: paged vs dense, batched vs alone,
chunked vs whole), for V4.1 and V4, with a trivial block planner (no scheduler)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import step_batch
from v41.cache import PagedCache, build_layout
from v41.engine.model_runner import ModelRunner
from v41.engine.step import StepBatch
from v41.models.reference import load
from v41.testing.tiny import make_tiny

TOL = 1e-4
MAX_BLOCKS = 32


class Planner:
    """Contiguous blocks per request: request slot s owns block ids s·MAX_BLOCKS .. (s+1)·MAX_BLOCKS − 1."""

    def __init__(self, cache: PagedCache, n_slots: int):
        self.cache, self.n_slots = cache, n_slots

    def batch(self, runs: list[tuple[int, list[int], int, list[int]]]) -> StepBatch:
        """runs: (request slot, new token ids, first position, all earlier token ids). Logits for every row
        of a single run, else for each run's last row."""
        return step_batch(self.cache, runs, MAX_BLOCKS, all_rows=len(runs) == 1)


def setup(arch: str, tmp, block_tokens: int):
    model = load(make_tiny(tmp, arch))
    layout = build_layout(model.cfg, block_tokens)
    cache = PagedCache(layout, num_blocks=4 * MAX_BLOCKS, num_state_rows=4, dtype=torch.float32, device="cpu")
    return model, ModelRunner(model, cache, index_scratch_bytes=4096), Planner(cache, 4)


def rel_l2(a, b):
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_chunked_paged_prefill_equals_reference_whole_sequence(tmp_path, arch, chunk):
    model, runner, planner = setup(arch, tmp_path / "m", block_tokens=8 if arch == "deepseek_v41" else 16)
    ids = torch.randint(3, 1000, (41,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = model(torch.tensor([ids]))[0]
    got = []
    for a in range(0, len(ids), chunk):
        got.append(runner.execute(planner.batch([(0, ids[a:a + chunk], a, ids[:a])])))
    assert rel_l2(torch.cat(got), whole) <= TOL


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_mixed_batch_of_prefills_and_decodes_equals_each_request_alone(tmp_path, arch):
    model, runner, planner = setup(arch, tmp_path / "m", block_tokens=16)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (37, 5, 19, 40)]
    # step 1: first chunks of different sizes; step 2: the rest; then 3 decode steps of all four together
    cuts = [9, 5, 11, 24]
    expected = [model(torch.tensor([p]))[0][-1] for p in prompts]
    out1 = runner.execute(planner.batch([(s, p[:c], 0, []) for s, (p, c) in enumerate(zip(prompts, cuts))]))
    out2 = runner.execute(planner.batch([(s, p[c:], c, p[:c]) for s, (p, c) in enumerate(zip(prompts, cuts))
                                         if c < len(p)]))
    finals = {s: out2[i] for i, s in enumerate([s for s, (p, c) in enumerate(zip(prompts, cuts)) if c < len(p)])}
    finals[1] = out1[1]
    for s, p in enumerate(prompts):
        assert rel_l2(finals[s][None], expected[s][None]) <= TOL
    seqs = [list(p) for p in prompts]
    for _ in range(3):
        nxt = [int(finals[s].argmax()) for s in range(4)]
        runs = [(s, [nxt[s]], len(seqs[s]), seqs[s]) for s in range(4)]
        out = runner.execute(planner.batch(runs))
        for s in range(4):
            seqs[s].append(nxt[s])
            ref = model(torch.tensor([seqs[s]]))[0][-1]
            assert rel_l2(out[s][None], ref[None]) <= TOL
            finals[s] = out[s]


def test_indexer_scratch_cap_does_not_change_results(tmp_path):
    model, runner, planner = setup("deepseek_v41", tmp_path / "m", block_tokens=8)
    ids = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    big = ModelRunner(model, runner.cache, index_scratch_bytes=1 << 30)
    a = big.execute(planner.batch([(1, ids, 0, [])]))
    b = runner.execute(planner.batch([(2, ids, 0, [])]))
    assert rel_l2(a, b) <= 1e-6


def test_runner_exports_dspark_aux_states_equal_to_reference(tmp_path):
    model, runner, planner = setup("deepseek_v41", tmp_path / "m", block_tokens=8)
    ids = torch.randint(3, 1000, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    _, aux = runner.execute(planner.batch([(0, ids, 0, [])]), return_aux=True)
    _, ref_aux = model.forward_chunk(torch.tensor(ids), model.new_cache(), return_aux=True)
    assert rel_l2(aux, ref_aux) <= TOL
