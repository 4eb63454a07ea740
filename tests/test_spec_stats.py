"""Speculative-decoding counters (issue 15 item 5; python/v41/engine/spec_stats.py, docs/speculative-decoding.md
"Metrics"): one verify step's arithmetic, pooled rates, adding up, and the engine-process wire form."""

from __future__ import annotations

import pytest

from v41.engine.params import CompletionOutput, RequestOutput
from v41.engine.spec_stats import SpecDecodeStats
from v41.serve import messages as m


def test_add_block_counts_drafts_tokens_and_each_position():
    s = SpecDecodeStats.empty(4)
    s.add_block(verified=4, accepted=2)
    s.add_block(verified=3, accepted=3)  # a shorter (adaptive) block counts what it verified
    s.add_block(verified=4, accepted=0)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 11, 5)
    assert s.verified_per_position == [3, 3, 3, 2]
    assert s.accepted_per_position == [2, 2, 1, 0]
    assert s.num_speculative_tokens == 4


def test_a_step_that_verifies_nothing_counts_nowhere():
    s = SpecDecodeStats.empty(3)
    s.add_block(verified=0, accepted=0)
    assert s == SpecDecodeStats.empty(3)


@pytest.mark.parametrize("verified, accepted", [(4, 0), (2, 3), (-1, 0), (1, -1)])
def test_add_block_refuses_impossible_counts(verified, accepted):
    s = SpecDecodeStats.empty(3)
    with pytest.raises(ValueError, match="add_block: need 0 <= accepted"):
        s.add_block(verified, accepted)
    assert s == SpecDecodeStats.empty(3)


def test_rates_are_pooled_over_draft_tokens_not_averaged_per_request():
    a, b = SpecDecodeStats.empty(4), SpecDecodeStats.empty(4)
    a.add_block(4, 4)  # rate 1.0 over 4 tokens
    for _ in range(3):
        b.add_block(4, 0)  # rate 0.0 over 12 tokens
    a.merge(b)
    assert a.acceptance_rate == pytest.approx(4 / 16)  # a mean of per-request rates would say 0.5
    assert a.mean_acceptance_length == pytest.approx(1 + 4 / 4)
    empty = SpecDecodeStats.empty(2)
    assert empty.acceptance_rate is None and empty.mean_acceptance_length is None


def test_merge_adds_every_counter_and_pads_shorter_position_lists():
    a, b = SpecDecodeStats.empty(2), SpecDecodeStats.empty(3)
    a.add_block(2, 1)
    b.add_block(3, 3)
    total = SpecDecodeStats()
    total.merge(a)
    total.merge(b)
    assert total == SpecDecodeStats(2, 5, 4, accepted_per_position=[2, 1, 1], verified_per_position=[2, 2, 1])


def test_since_gives_what_was_added_after_a_snapshot_and_copy_is_independent():
    s = SpecDecodeStats.empty(3)
    s.add_block(3, 1)
    before = s.copy()
    s.add_block(2, 2)
    assert before == SpecDecodeStats(1, 3, 1, accepted_per_position=[1, 0, 0], verified_per_position=[1, 1, 1])
    assert s.since(before) == SpecDecodeStats(1, 2, 2, accepted_per_position=[1, 1, 0],
                                              verified_per_position=[1, 1, 0])


def test_to_dict_round_trips_and_carries_the_derived_figures():
    s = SpecDecodeStats.empty(2)
    s.add_block(2, 1)
    d = s.to_dict()
    assert d["acceptance_rate"] == 0.5 and d["mean_acceptance_length"] == 2.0
    assert SpecDecodeStats.from_dict(d) == s


def test_completion_counts_cross_the_engine_process_wire():
    s = SpecDecodeStats.empty(3)
    s.add_block(3, 2)
    out = RequestOutput("r", None, [0, 5], None, [CompletionOutput(0, "a", [7], None, None, spec_decode=s),
                                                   CompletionOutput(1, "b", [8], None, None)], finished=False)
    wire = m.decode(m.encode(m.Outputs([m.output_to_dict(out, with_prompt=False)])))
    back = m.output_from_dict(wire.outputs[0], None, [0, 5])
    assert back.outputs[0].spec_decode == s and back.outputs[1].spec_decode is None
