"""Tests for the scheduler bindings ``v41._native.Scheduler`` (crate ``v41-sched``)."""

import numpy as np
import pytest

from v41._native import Scheduler, StepOutput

PAGE = 16
LAYOUT = [
    {"name": "swa", "tokens_per_block": PAGE, "tokens_per_entry": 1, "window_tokens": 32, "num_blocks": 64},
    {"name": "ckv2", "tokens_per_block": PAGE, "tokens_per_entry": 2, "num_blocks": 64},
    {"name": "idx2", "tokens_per_block": PAGE, "tokens_per_entry": 2, "window_tokens": None, "num_blocks": 64},
    {"name": "cstate", "state_rows": 8},
]


def make(budget=256, seqs=8, max_model_len=512, caching=True, layout=LAYOUT, threshold=None):
    return Scheduler(
        layout,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=max_model_len,
        long_prefill_token_threshold=threshold,
        enable_prefix_caching=caching,
    )


def prompt(n, seed=1):
    return [seed * 1000 + i for i in range(n)]


def run_to_end(s, token=7):
    """Steps and reports one sampled token per sampling request until nothing is left."""
    finished = []
    for _ in range(1000):
        out = s.step()
        finished += out.finished
        ids = [int(i) for i, d in zip(out.req_ids, out.do_sample) if d]
        s.update_from_output(ids, [[token]] * len(ids))
        stats = s.stats()
        if stats["running"] + stats["waiting"] == 0:
            return finished + s.step().finished
    raise AssertionError("did not finish")


def test_prefill_then_decode_returns_typed_numpy_arrays():
    s = make()
    assert s.kind_names == ["swa", "ckv2", "idx2"]
    s.add_request(5, prompt(20), max_tokens=3)
    out = s.step()
    assert isinstance(out, StepOutput)
    assert (out.num_reqs, out.num_tokens) == (1, 20)
    expected = {
        "req_ids": np.uint64, "num_scheduled": np.uint32, "start_pos": np.uint32, "num_draft_tokens": np.uint32,
        "is_prefill": np.bool_, "do_sample": np.bool_, "prefix_hit_tokens": np.uint32, "state_rows": np.int32,
        "table_rows": np.int32,
    }
    for name, dtype in expected.items():
        arr = getattr(out, name)
        assert isinstance(arr, np.ndarray) and arr.dtype == dtype and arr.shape == (1,), name
    assert out.token_ids.dtype == np.uint32 and out.positions.dtype == np.uint32
    np.testing.assert_array_equal(out.token_ids, prompt(20))
    np.testing.assert_array_equal(out.positions, np.arange(20))
    assert set(out.table_diffs) == set(out.max_blocks) == set(out.slot_mappings) == {"swa", "ckv2", "idx2"}
    diff = out.table_diffs["swa"]  # admission: the whole table of the request's row
    assert diff.dtype == np.int32 and diff.shape == (3, 2) and out.max_blocks["swa"] == 2
    assert diff[0].tolist() == [out.table_rows[0]] * 2 and diff[1].tolist() == [0, 1]
    swa = diff[2][None, :]
    assert out.max_blocks["ckv2"] == 2 and out.table_diffs["ckv2"].shape == (3, 2)  # 10 entries, 8 per block
    slots = out.slot_mappings["swa"]
    assert slots.dtype == np.int32 and slots.shape == (20,)
    assert slots[17] == swa[0, 1] * PAGE + 1
    ckv = out.slot_mappings["ckv2"]
    assert (ckv[0::2] == -1).all() and (ckv[1::2] >= 0).all()
    assert out.is_prefill[0] and out.do_sample[0]

    s.update_from_output([5], [[42]])
    out = s.step()
    assert (int(out.start_pos[0]), int(out.num_scheduled[0]), int(out.token_ids[0])) == (20, 1, 42)
    assert not out.is_prefill[0]
    s.update_from_output([5], [[43]])
    s.step()
    s.update_from_output([5], [[44]])
    assert 5 not in s
    assert s.step().finished == [(5, "length")]
    s.check_invariants()


def test_chunked_prefill_under_a_small_budget():
    s = make(budget=8)
    s.add_request(1, prompt(20), max_tokens=4)
    chunks = []
    for _ in range(3):
        out = s.step()
        chunks.append((int(out.start_pos[0]), int(out.num_scheduled[0]), bool(out.do_sample[0])))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_long_prefill_threshold_caps_each_request():
    s = make(threshold=5)
    s.add_request(1, prompt(12), max_tokens=4)
    s.add_request(2, prompt(12, 2), max_tokens=4)
    assert s.step().num_scheduled.tolist() == [5, 5]


def test_prefix_hit_on_repeated_prompt_is_page_aligned_and_shorter_than_prompt():
    s = make()
    s.add_request(1, prompt(40), max_tokens=1)
    run_to_end(s)
    s.add_request(2, prompt(40), max_tokens=1)
    s.add_request(3, prompt(48), max_tokens=1)  # 3 full pages cached? only 2 (40 tokens computed)
    out = s.step()
    assert out.prefix_hit_tokens.tolist() == [32, 32]
    assert out.start_pos.tolist() == [32, 32]
    assert all(h % PAGE == 0 and h < 40 for h in out.prefix_hit_tokens.tolist())
    stats = s.stats()
    assert stats["prefix_hit_tokens"] == 64 and stats["prefix_query_tokens"] == 40 + 40 + 48
    assert 0 < stats["prefix_hit_rate"] < 1


def test_salts_isolate_prefix_caches():
    s = make()
    s.add_request(1, prompt(40), max_tokens=1, cache_salt="alice")
    run_to_end(s)
    s.add_request(2, prompt(40), max_tokens=1, cache_salt="bob")
    s.add_request(3, prompt(40), max_tokens=1)
    s.add_request(4, prompt(40), max_tokens=1, cache_salt="alice")
    assert s.step().prefix_hit_tokens.tolist() == [0, 0, 32]


def test_abort_frees_blocks_back_to_baseline():
    s = make(budget=8)
    baseline = s.stats()
    s.add_request(1, prompt(30), max_tokens=4)
    s.step()  # mid-prefill
    assert s.stats()["blocks"]["swa"]["used"] > 0
    s.abort_request(1)
    s.reset_prefix_cache()
    assert s.stats()["blocks"] == baseline["blocks"]
    assert s.stats()["running"] == s.stats()["waiting"] == 0
    assert s.step().finished == [(1, "abort")]
    with pytest.raises(KeyError, match="unknown request 1"):
        s.abort_request(1)


def test_speculative_drafts_are_scheduled_and_rejections_roll_back():
    s = make()
    s.add_request(1, prompt(10), max_tokens=16, lookahead=2)
    s.step()
    s.update_from_output([1], [[50]], accepted=[0], drafts=[[51, 52, 53]])
    out = s.step()
    assert out.num_draft_tokens.tolist() == [2]
    assert out.token_ids.tolist() == [50, 51, 52]
    s.update_from_output([1], [[51, 60]], accepted=[1], drafts=None)
    out = s.step()
    assert (int(out.start_pos[0]), int(out.num_scheduled[0])) == (12, 1)
    with pytest.raises(ValueError, match="accepted 1 drafts but 0 were scheduled"):
        s.update_from_output([1], [[1, 2]], accepted=[1])


def test_preemption_is_reported_under_a_tiny_pool():
    tiny = [dict(k, num_blocks=4) if "num_blocks" in k else k for k in LAYOUT]
    s = make(layout=tiny)
    s.add_request(1, prompt(32), max_tokens=8)
    s.add_request(2, prompt(32, 2), max_tokens=8, priority=1)
    out = s.step()
    assert out.req_ids.tolist() == [1, 2]
    s.update_from_output([1, 2], [[1], [1]])
    preempted, finished = [], []
    for _ in range(8):
        out = s.step()
        preempted += out.preempted
        finished += out.finished
        ids = [int(i) for i, d in zip(out.req_ids, out.do_sample) if d]
        s.update_from_output(ids, [[1]] * len(ids))
    assert 2 in preempted and s.stats()["num_preemptions"] >= 1
    s.check_invariants()
    assert sorted(finished + run_to_end(s)) == [(1, "length"), (2, "length")]


def test_errors_name_the_limit():
    s = make(max_model_len=64)
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(64\)"):
        s.add_request(1, prompt(60), max_tokens=5)
    small = [dict(k, num_blocks=2) if k["name"] == "ckv2" else k for k in LAYOUT]
    s = make(layout=small)
    with pytest.raises(ValueError, match=r"cache kind 'ckv2'.*num_blocks=2"):
        s.add_request(1, prompt(40), max_tokens=10)
    s.add_request(2, prompt(4), max_tokens=4)
    with pytest.raises(ValueError, match="already exists"):
        s.add_request(2, prompt(4), max_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        s.add_request(3, [], max_tokens=4)
    with pytest.raises(KeyError):
        s.abort_request(99)
    with pytest.raises(KeyError):
        s.finish_request(99)
    with pytest.raises(ValueError, match="equal lengths"):
        s.update_from_output([2], [])


def test_invalid_layouts_are_rejected():
    with pytest.raises(ValueError, match="share tokens_per_block"):
        make(layout=[LAYOUT[0], dict(LAYOUT[1], tokens_per_block=32)])
    with pytest.raises(ValueError, match="unknown layout key 'window'"):
        make(layout=[dict(LAYOUT[0], window=3)])
    with pytest.raises(ValueError, match="unknown cache kind name"):
        make(layout=[dict(LAYOUT[1], name="kv")])
    with pytest.raises(ValueError, match="max_num_seqs must be > 0"):
        make(seqs=0)
