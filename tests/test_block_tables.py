"""Persistent block tables driven by the scheduler's diffs (engine/block_tables.py): the eager input buffers and the
CUDA-graph static inputs (run here on the CPU, without a graph) must see the tables the scheduler holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from v41 import _native
from v41.engine.block_tables import DeviceBlockTables
from v41.engine.cuda_graph import GraphInputs
from v41.engine.host_step import HostStep
from v41.engine.input_buffers import InputBuffers

PAGE, SEQS, WIDTH = 4, 3, 16
LAYOUT = [{"name": "swa", "tokens_per_block": PAGE, "tokens_per_entry": 1, "window_tokens": 8, "num_blocks": 40},
          {"name": "ckv2", "tokens_per_block": PAGE, "tokens_per_entry": 2, "num_blocks": 40}]


def host_step(plan) -> HostStep:
    """The scheduler's plan as a HostStep (no logits or Engram rows needed here)."""
    return HostStep(token_ids=plan.token_ids.astype(np.int64), positions=plan.positions.astype(np.int64),
                    num_scheduled=plan.num_scheduled.astype(np.int64), start_pos=plan.start_pos.astype(np.int64),
                    table_rows=plan.table_rows, table_diffs=dict(plan.table_diffs), max_blocks=dict(plan.max_blocks),
                    slot_mapping=dict(plan.slot_mappings), state_rows=plan.state_rows,
                    logits_rows=np.zeros(0, dtype=np.int64))


def expected_tables(plan, mirror: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Apply the plan's diffs to numpy mirrors; the step's [R, max_blocks] tables."""
    out = {}
    for k, (rows, cols, blocks) in plan.table_diffs.items():
        mirror[k][rows, cols] = blocks
        out[k] = mirror[k][plan.table_rows, :plan.max_blocks[k]]
    return out


def drive(steps: int = 40):
    """A scheduler with prefix hits, window release, finishes and row reuse; yields (plan, HostStep)."""
    s = _native.Scheduler(LAYOUT, max_num_batched_tokens=64, max_num_seqs=SEQS, max_model_len=48,
                          enable_prefix_caching=True)
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(1, 100, 8)]
    for i in range(8):
        s.add_request(i, shared + [int(t) for t in rng.integers(1, 100, 3 + 2 * i)], 6 + i % 5)
    for _ in range(steps):
        plan = s.step()
        if plan.num_reqs == 0:
            return
        yield plan, host_step(plan)
        s.update_from_output([int(r) for r, d in zip(plan.req_ids, plan.do_sample) if d],
                             [[7] for d in plan.do_sample if d])


def test_eager_buffers_hold_the_schedulers_tables():
    tables = DeviceBlockTables({k["name"]: WIDTH for k in LAYOUT}, SEQS, "cpu")
    buffers = InputBuffers("cpu", 64, SEQS, tables, [], {})
    mirror = {k["name"]: np.full((SEQS, WIDTH), -1, dtype=np.int64) for k in LAYOUT}
    seen_reuse = False
    for plan, step in drive():
        batch = buffers.load(step)
        want = expected_tables(plan, mirror)
        seen_reuse |= any(d.shape[1] > 0 and d[2].min() < 0 for d in plan.table_diffs.values())
        for k, t in want.items():
            assert np.array_equal(batch.block_tables[k].numpy(), t), k
    assert seen_reuse  # a released window block or a reused row's tail was cleared through a diff
    assert (tables.tables["swa"][SEQS] == -1).all()


def test_graph_inputs_gather_the_same_tables_at_full_width():
    tables = DeviceBlockTables({k["name"]: WIDTH for k in LAYOUT}, SEQS, "cpu")
    static = {k["name"]: torch.full((4, WIDTH), -1, dtype=torch.int64) for k in LAYOUT}
    graph = GraphInputs(4, tables, static, {}, [], 48, 0, torch.device("cpu"))
    buffers = InputBuffers("cpu", 64, SEQS, tables, [], {})
    mirror = {k["name"]: np.full((SEQS, WIDTH), -1, dtype=np.int64) for k in LAYOUT}
    graph_steps = 0
    for plan, step in drive():
        if not step.is_decode_only:  # the runner's eager path shares the tables
            buffers.load(step)
            expected_tables(plan, mirror)
            continue
        graph_steps += 1
        assert graph.fits(step)
        graph.fill(step)
        graph.prologue()  # what the captured graph runs before the forward
        want = expected_tables(plan, mirror)
        r = plan.num_reqs
        for k, t in want.items():
            got = graph.batch().block_tables[k].numpy()
            assert got.shape == (4, WIDTH)
            assert np.array_equal(got[:r, :t.shape[1]], t) and (got[:r, t.shape[1]:] == -1).all()
            assert (got[r:] == -1).all()  # padding rows read the padding row
    assert graph_steps > 10
    assert (tables.tables["ckv2"][SEQS] == -1).all()


def test_a_diff_outside_the_tables_is_refused_and_a_large_one_runs_eager():
    tables = DeviceBlockTables({"swa": 4}, 2, "cpu")
    with pytest.raises(ValueError, match="outside"):
        tables.check("swa", np.array([[0], [4], [1]]))
    with pytest.raises(ValueError, match="outside"):
        tables.check("swa", np.array([[2], [0], [1]]))  # the padding row is never a request's
    graph = GraphInputs(1, tables, {"swa": torch.full((1, 4), -1, dtype=torch.int64)}, {}, [], 8, 0,
                        torch.device("cpu"))
    big = HostStep(token_ids=np.zeros(1, np.int64), positions=np.zeros(1, np.int64), num_scheduled=np.ones(1, np.int64),
                   start_pos=np.zeros(1, np.int64), table_rows=np.zeros(1, np.int32),
                   table_diffs={"swa": np.zeros((3, graph.diff_capacity + 1), np.int32)}, max_blocks={"swa": 1},
                   slot_mapping={"swa": np.zeros(1, np.int32)}, state_rows=np.zeros(1, np.int32),
                   logits_rows=np.zeros(1, np.int64))
    assert not graph.fits(big)
