"""Pieces of the tensor-parallel runtime that need no second process: the backend self-test's verdicts (KF-20),
the step message codec (no pickles), the segment placement rule."""

from __future__ import annotations

import msgpack
import pytest
import torch

from v41.distributed import runtime
from v41.distributed.group import TPGroup
from v41.distributed.selftest import known_data, run_selftest
import numpy as np

from v41.engine.host_step import HostStep


class FakeGroup(TPGroup):
    """Two 'ranks' simulated in one process: all_reduce adds the other rank's known data, optionally wrong."""

    def __init__(self, corrupt_at: int | None = None, raises: bool = False):
        self.rank, self.world_size, self.corrupt_at, self.raises = 0, 2, corrupt_at, raises

    def all_reduce(self, x):
        if self.raises:
            raise RuntimeError("all_reduce #3: rank 1 (pid 99) died")
        out = (x.float() + known_data(x.numel(), 1, torch.float32, x.device)).to(x.dtype)
        if self.corrupt_at is not None and x.numel() * x.element_size() >= self.corrupt_at:
            out[-1] += 1
        return out

    def all_gather(self, x, dim=-1):
        return torch.cat([x, known_data(x.numel(), 1, x.dtype, x.device).view_as(x)], dim=dim)


def test_selftest_passes_a_correct_backend():
    assert run_selftest(FakeGroup(), "cpu", max_bytes=1 << 20) is None


def test_selftest_names_the_size_and_dtype_that_is_wrong():
    reason = run_selftest(FakeGroup(corrupt_at=64 << 10), "cpu", max_bytes=1 << 20)
    assert reason is not None and "65536 bytes" in reason and "1 of" in reason


def test_selftest_turns_a_collective_error_into_a_reason():
    assert "rank 1 (pid 99) died" in run_selftest(FakeGroup(raises=True), "cpu")


def test_known_data_sums_are_exact_in_bf16():
    for w in range(1, 9):
        exact = sum(known_data(4096, r, torch.float64, "cpu") for r in range(w))
        assert torch.equal(exact.to(torch.bfloat16).double(), exact)


def test_step_message_round_trips_without_pickle():
    i64, i32 = np.int64, np.int32
    step = HostStep(token_ids=np.array([5, 6, 7], i64), positions=np.array([0, 1, 9], i64),
                    num_scheduled=np.array([2, 1], i64), start_pos=np.array([0, 9], i64),
                    table_rows=np.array([1, 0], i32), table_diffs={"swa": np.array([[1, 0], [0, 1], [3, -1]], i32)},
                    max_blocks={"swa": 2},
                    slot_mapping={"swa": np.array([48, 49, 80], i32), "ckv2": np.array([-1, 24, -1], i32)},
                    state_rows=np.array([0, 1], i32), logits_rows=np.array([1, 2], i64),
                    engram_rows={1: np.arange(12, dtype=i64).reshape(3, 4)})
    data = step.encode()
    assert b"\x80" not in data[:1]  # a msgpack map, not a pickle protocol header
    got = HostStep.decode(data)
    assert got.starts() == step.starts() == ((0, 2, 0), (2, 1, 9))
    for name in ("token_ids", "positions", "num_scheduled", "start_pos", "state_rows", "logits_rows"):
        a, b = getattr(got, name), getattr(step, name)
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert got.max_blocks == step.max_blocks and np.array_equal(got.table_rows, step.table_rows)
    for field in ("table_diffs", "slot_mapping", "engram_rows"):
        want = getattr(step, field)
        assert getattr(got, field).keys() == want.keys()
        assert all(np.array_equal(getattr(got, field)[k], v) for k, v in want.items())
    with pytest.raises(ValueError, match="malformed step message"):
        HostStep.decode(msgpack.packb({"token_ids": 1}))


def test_segments_cut_each_request_at_window_boundaries():
    i64 = np.int64
    step = HostStep(token_ids=np.zeros(7, i64), positions=np.array([3, 4, 5, 6, 7, 8, 2], i64),
                    num_scheduled=np.array([6, 1], i64), start_pos=np.array([3, 2], i64),
                    table_rows=np.array([0, 1], np.int32), table_diffs={}, max_blocks={},
                    slot_mapping={}, state_rows=np.array([0, 1], np.int32), logits_rows=np.array([5, 6], i64))
    assert step.segments(4).tolist() == [[0, -1, -1, -1], [1, 2, 3, 4], [5, -1, -1, -1], [6, -1, -1, -1]]
    assert step.segments(2).tolist() == [[0, -1], [1, 2], [3, 4], [5, -1], [6, -1]]


def test_segments_fall_back_to_a_file_when_dev_shm_is_small(monkeypatch, tmp_path):
    monkeypatch.setattr(runtime.tempfile, "gettempdir", lambda: str(tmp_path))
    assert runtime.segment_dir(1 << 60) == str(tmp_path)
