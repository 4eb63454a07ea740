"""Pieces of the tensor-parallel runtime that need no second process: the backend self-test's verdicts (KF-20),
the step message codec (no pickles), the segment placement rule."""

from __future__ import annotations

import msgpack
import pytest
import torch

from v41.distributed import runtime
from v41.distributed.group import TPGroup
from v41.distributed.selftest import known_data, run_selftest
from v41.engine.step import StepBatch, decode_step, encode_step


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
    b = StepBatch(token_ids=torch.tensor([5, 6, 7]), positions=torch.tensor([0, 1, 9]),
                  req_index=torch.tensor([0, 0, 1]), starts=((0, 2, 0), (2, 1, 9)),
                  block_tables={"swa": torch.tensor([[3, -1], [4, 5]])},
                  slot_mapping={"swa": torch.tensor([48, 49, 80]), "ckv2": torch.tensor([-1, 24, -1])},
                  state_rows=torch.tensor([0, 1]), engram_history=((), (1, 2, 3)), logits_rows=torch.tensor([1, 2]))
    data = encode_step(b)
    assert b"\x80" not in data[:1]  # a msgpack map, not a pickle protocol header
    got = decode_step(data, "cpu")
    assert got.starts == b.starts and got.engram_history == b.engram_history
    for name in ("token_ids", "positions", "req_index", "state_rows", "logits_rows"):
        assert torch.equal(getattr(got, name), getattr(b, name))
    assert all(torch.equal(got.slot_mapping[k], v) for k, v in b.slot_mapping.items())
    assert torch.equal(got.block_tables["swa"], b.block_tables["swa"])
    with pytest.raises(ValueError, match="malformed step message"):
        decode_step(msgpack.packb({"token_ids": 1}), "cpu")


def test_segments_fall_back_to_a_file_when_dev_shm_is_small(monkeypatch, tmp_path):
    monkeypatch.setattr(runtime.tempfile, "gettempdir", lambda: str(tmp_path))
    assert runtime.segment_dir(1 << 60) == str(tmp_path)
