"""The reference model's incremental path equals its whole-sequence path (docs/numerics.md §4), for V4 and V4.1,
across odd/even ratio-2 boundaries, the window boundary and candidate-block boundaries; DSpark aux states
and draft blocks behave as docs/model.md §3.9 says."""

from __future__ import annotations

import pytest
import torch

from v41.models.reference import load
from v41.testing.tiny import make_tiny

TOL = 1e-4


@pytest.fixture(scope="module")
def v41_model(tmp_path_factory):
    return load(make_tiny(tmp_path_factory.mktemp("v41"), "deepseek_v41"))


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory):
    return load(make_tiny(tmp_path_factory.mktemp("v4"), "deepseek_v4"))


def rel_l2(a, b):
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


def run_chunks(model, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    cache, out, start = model.new_cache(), [], 0
    for n in sizes:
        out.append(model.forward_chunk(ids[start:start + n], cache))
        start += n
    assert start == ids.numel()
    return torch.cat(out)


def prompt(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 1000, (t,), generator=torch.Generator().manual_seed(seed))


SPLITS_40 = [
    [1] * 40,                 # token by token
    [7, 1, 1, 31],            # chunk ends on an even position (pending ratio-2 token), then odd
    [8, 9, 23],               # the window (8) boundary and an odd-length chunk
    [15, 17, 8],              # candidate blocks of 4 entries: boundaries at 16 and 32 (ratio 1)
    [2, 2, 3, 5, 11, 17],
]


@pytest.mark.parametrize("sizes", SPLITS_40)
def test_v41_incremental_matches_whole_sequence(v41_model, sizes):
    ids = prompt(40)
    whole = v41_model(ids[None])[0]
    assert rel_l2(run_chunks(v41_model, ids, sizes), whole) <= TOL


@pytest.mark.parametrize("sizes", SPLITS_40)
def test_v4_incremental_matches_whole_sequence(v4_model, sizes):
    ids = prompt(40, seed=1)
    whole = v4_model(ids[None])[0]
    assert rel_l2(run_chunks(v4_model, ids, sizes), whole) <= TOL


def test_v41_default_config_exercises_every_layer_role(v41_model):
    plan = v41_model.cfg.plan
    assert [p.ratio for p in plan[:2]] == [0, 0]
    assert plan[1].engram and plan[4].engram and plan[4].owns_compressor and plan[4].ratio == 2
    assert plan[6].is_candidate_source and plan[6].ratio == 1
    assert any(p.uses_candidate_filter and not p.owns_compressor for p in plan)
    assert any(p.ratio > 0 and not p.is_index_source for p in plan)
    assert v41_model.mtp is not None and len(v41_model.mtp) == 3
    cfg = v41_model.cfg
    # 40 tokens cross the window, top-k of a ratio-2 source, and the candidate filter of the ratio-1 source
    assert cfg.sliding_window < 40 and cfg.index_topk < 40 // 2
    assert cfg.candidate_topk_blocks * cfg.candidate_block_size < 40


def test_v41_candidate_filter_really_restricts_selection(v41_model):
    """At 40 tokens the filtered index source picks only inside the published candidate blocks, and picks
    differently than it would unfiltered."""
    from v41.models.reference.attention import select_topk
    from v41.models.reference.csa2 import CSA2Attention

    ids = prompt(40, seed=3)
    calls = []
    orig = CSA2Attention.select

    def spy(self, scores, n_t, cand_mask):
        out = orig(self, scores, n_t, cand_mask)
        calls.append((self.plan, scores, n_t, cand_mask, out[0]))
        return out

    CSA2Attention.select = spy
    try:
        v41_model(ids[None])
    finally:
        CSA2Attention.select = orig
    filtered = [c for c in calls if c[0].uses_candidate_filter]
    assert filtered
    differs = False
    for plan, scores, n_t, mask, picks in filtered:
        visible = torch.arange(scores.shape[1])[None, :] < n_t[:, None]
        unfiltered = select_topk(scores.masked_fill(~visible, float("-inf")), v41_model.cfg.index_topk)
        differs |= not torch.equal(unfiltered, picks)
        valid = picks >= 0
        assert mask.gather(1, picks.clamp(min=0))[valid].all(), "a pick outside the candidate blocks"
    assert differs, "the candidate filter never changed a selection at 40 tokens"


def test_v41_aux_hidden_states_shape_and_incremental_equality(v41_model):
    ids = prompt(20, seed=4)
    cfg = v41_model.cfg
    _, aux = v41_model.forward_chunk(ids, v41_model.new_cache(), return_aux=True)
    assert aux.shape == (20, len(cfg.dspark_target_layer_ids) * cfg.hidden_size)
    cache = v41_model.new_cache()
    parts = [v41_model.forward_chunk(ids[i:i + 1], cache, return_aux=True)[1] for i in range(20)]
    assert rel_l2(torch.cat(parts), aux) <= TOL


def test_v41_draft_block_is_deterministic_and_incremental_safe(v41_model):
    cfg = v41_model.cfg
    ids = prompt(30, seed=5)
    cache = v41_model.new_cache()
    logits = v41_model.forward_chunk(ids, cache)
    anchor = int(logits[-1].argmax())
    d1 = v41_model.draft(cache, anchor)
    d2 = v41_model.draft(cache, anchor)
    assert d1.tokens.shape == (cfg.dspark_block_size,) and torch.equal(d1.tokens, d2.tokens)
    assert d1.logits.shape == (cfg.dspark_block_size, cfg.vocab_size)
    assert torch.isfinite(d1.confidence).all()
    assert torch.equal(d1.tokens, d1.logits.argmax(dim=-1))
    assert d1.positions.tolist() == list(range(30, 30 + cfg.dspark_block_size))
    # the ring built token by token drafts the same block
    cache2 = v41_model.new_cache()
    for i in range(30):
        v41_model.forward_chunk(ids[i:i + 1], cache2)
    d3 = v41_model.draft(cache2, anchor)
    assert torch.equal(d1.tokens, d3.tokens)
    assert rel_l2(d3.logits, d1.logits) <= TOL


def test_v41_draft_sampling_is_seeded(v41_model):
    ids = prompt(12, seed=6)
    cache = v41_model.new_cache()
    v41_model.forward_chunk(ids, cache)
    a = v41_model.draft(cache, 5, temperature=1.0, generator=torch.Generator().manual_seed(7)).tokens
    b = v41_model.draft(cache, 5, temperature=1.0, generator=torch.Generator().manual_seed(7)).tokens
    assert torch.equal(a, b)


def test_v41_draft_markov_head_changes_logits(v41_model):
    """Markov correction: the logits of draft i depend on the previous output token (§3.9)."""
    ids = prompt(12, seed=8)
    cache = v41_model.new_cache()
    v41_model.forward_chunk(ids, cache)
    d_a, d_b = v41_model.draft(cache, 5), v41_model.draft(cache, 6)
    assert not torch.allclose(d_a.logits[0], d_b.logits[0])


def test_forward_rejects_bad_input(v41_model):
    with pytest.raises(ValueError):
        v41_model.forward_chunk(torch.tensor([], dtype=torch.long), v41_model.new_cache())
    with pytest.raises(ValueError):
        v41_model.forward_chunk(torch.tensor([v41_model.cfg.vocab_size]), v41_model.new_cache())
    with pytest.raises(RuntimeError):
        v41_model.draft(v41_model.new_cache(), 3)
