"""Adaptive verification (issue 15; docs/speculative-decoding.md §4; ``engine/adaptive_verify.py``): the planner's
rule on hand-made profiles, the fast drafter's confidences against the oracle's, and the engine with it on — greedy
tokens stay the oracle's while requests verify shorter prefixes. Exactness of sampled adaptive verification is
the χ² test in ``test_spec_verify_lossless.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_spec_decode import PROMPTS, check_against_oracle

from v41.engine import model_runner, spec_decode
from v41.engine.adaptive_verify import AdaptivePlanner, VerifyCosts, survivals
from v41.engine.llm import LLM
from v41.engine.params import SamplingParams
from v41.models.reference import loader
from v41.testing.embedded import embedded_model_dir


@pytest.fixture(scope="module")
def oracle():
    return loader.load(embedded_model_dir())


def adaptive_llm(k: int, **kwargs) -> LLM:
    spec = {"num_speculative_tokens": k, "enable_adaptive_verification": True}
    return LLM(None, speculative_config=spec, **kwargs)


KEYS = [11, 12]  # two requests' sampling keys


@pytest.fixture
def drafting_pays(monkeypatch):
    """A profile under which drafting always pays (the measured one depends on the machine's load)."""
    cheap = costs([[1.0, 1.02, 1.04, 1.06, 1.08, 1.1]] * 3, [0.05] * 3)
    monkeypatch.setattr(model_runner, "measure_costs", lambda runner, k: VerifyCosts(
        cheap.sizes, cheap.verify_s[:, :k + 1], cheap.draft_s, cheap.uniform))


def costs(verify: list[list[float]], draft: list[float], sizes=(1, 2, 4), uniform=False) -> VerifyCosts:
    return VerifyCosts(tuple(sizes), np.array(verify, dtype=np.float64), np.array(draft), uniform)


def test_survivals_are_running_products_of_sigmoids():
    c = np.array([[0.0, np.log(3.0), -np.inf], [np.nan, 5.0, 5.0]])
    s = survivals(c)
    np.testing.assert_allclose(s[0], [0.5, 0.5 * 0.75, 0.0])
    np.testing.assert_allclose(s[1], [0.0, 0.0, 0.0])  # a NaN logit: never accepted


def test_the_planner_maximises_tokens_per_second_and_keeps_prefixes():
    # One size; verify cost 1, 1.5, 1.6, 1.7 for q = 1..4, draft 0 (so seconds = verify cost).
    planner = AdaptivePlanner(costs([[1.0, 1.5, 1.6, 1.7]], [0.0], sizes=(2,)), k=3, max_tokens=64)
    est = np.array([[0.9, 0.8, 0.1], [0.5, 0.2, 0.1]])
    # q=1: 2/1 = 2; q=2: (2 + .9 + .8)/1.5 = 2.47; q=3: (2 + 2.4)/1.6 = 2.75; q=4: (2 + 2.6)/1.7 = 2.71
    assert planner.choose_q(est) == 3
    current = np.array([[0.6, 0.55, 0.5], [0.9, 0.3, 0.2]])
    keep = planner.plan(current, [est[0], est[1]], KEYS)  # the 4 largest current survivals: .9, .6, .55, .5
    assert keep == [3, 1]
    np.testing.assert_allclose(planner.prior, current.mean(axis=0))
    ties = planner.plan(np.full((2, 3), 0.5), [est[0], est[1]], KEYS)  # equal values: earlier request, earlier draft
    assert ties == [3, 1]


def test_the_budget_comes_from_estimates_never_from_the_current_block():
    planner = AdaptivePlanner(costs([[1.0, 1.5, 1.6, 1.7]], [0.0], sizes=(2,)), k=3, max_tokens=64)
    est = [np.array([0.9, 0.8, 0.1]), np.array([0.5, 0.2, 0.1])]
    for current in (np.full((2, 3), 0.99), np.full((2, 3), 0.01), np.array([[0.2, 0.1, 0.0], [0.9, 0.9, 0.9]])):
        assert sum(planner.plan(current, est, KEYS)) == 4  # B·(q − 1) with q = 3, whatever the current block says
    low = [np.array([0.05, 0.01, 0.0])] * 2
    assert planner.plan(np.full((2, 3), 0.99), low, KEYS) == [0, 0]  # q = 1: verifying costs more than it brings
    planner.prior = np.array([0.9, 0.8, 0.1])  # requests without a previous block take the last plan's curve
    assert sum(planner.plan(np.full((2, 3), 0.5), [None, None], [5, 6])) == 2 * 2


def test_plans_stay_within_the_token_budget_and_same_key_pairs_verify_everything():
    cheap = costs([[1.0, 1.0, 1.0, 1.0]], [0.0], sizes=(2,))
    est = [np.full(3, 0.9)] * 2
    assert AdaptivePlanner(cheap, k=3, max_tokens=64).plan(np.full((2, 3), 0.9), est, KEYS) == [3, 3]
    # a budget of 5 tokens: q = 2 (2·2 <= 5), the 2 drafts go to the largest survivals (ties: the first request)
    assert AdaptivePlanner(cheap, k=3, max_tokens=5).plan(np.full((2, 3), 0.9), est, KEYS) == [2, 0]
    steep = AdaptivePlanner(costs([[1.0, 9.0, 9.0, 9.0]], [0.0], sizes=(2,)), k=3, max_tokens=64)
    assert steep.plan(np.full((2, 3), 0.9), est, KEYS) == [0, 0]
    assert steep.plan(np.full((2, 3), 0.9), est, [7, 7]) == [3, 3]  # one key: nobody decides on the other


def test_no_draft_pass_where_plain_decoding_wins_by_the_estimates():
    # plain step 1.0 s; any verify 1.2 s plus a 0.5 s draft pass: drafting pays only with confident estimates
    planner = AdaptivePlanner(costs([[1.0, 1.2, 1.2, 1.2]], [0.5], sizes=(2,)), k=3, max_tokens=64)
    assert not planner.should_draft(KEYS, [np.array([0.2, 0.05, 0.0])] * 2)  # 2 / 1.0 > (2 + 0.5) / 1.7
    assert planner.should_draft(KEYS, [np.array([0.9, 0.8, 0.7])] * 2)  # (2 + 4.8) / 1.7 = 4.0 > 2
    assert planner.should_draft([3, 3], [np.zeros(3)] * 2)  # a shared key: verify everything, so draft
    planner.prior, planner.prior_keys = np.zeros(3), {11}
    assert planner.should_draft([11, 99], [None, np.array([0.9, 0.8, 0.7])])  # key 11 ignores the prior


def test_graph_profiles_verify_the_same_prefix_for_every_request_and_scale_past_the_largest_size():
    c = costs([[1.0, 1.1, 1.2], [1.0, 1.2, 1.4], [2.0, 2.4, 2.8]], [0.5, 0.5, 0.5], uniform=True)
    planner = AdaptivePlanner(c, k=2, max_tokens=64)
    assert planner.plan(np.array([[0.9, 0.1], [0.1, 0.0], [0.5, 0.4]]), [None] * 3, [1, 2, 3]) == [2, 2, 2]
    assert c.step_seconds(3)[1] == pytest.approx(0.5 + 2.4)  # 3 requests pad to the size-4 graphs
    assert c.step_seconds(8)[0] == pytest.approx((0.5 + 2.0) * 2)  # beyond 4: scaled by 8 / 4
    assert c.step_seconds(8, drafted=False)[0] == pytest.approx(2.0 * 2)  # a plain step runs no draft pass
    with pytest.raises(ValueError, match="3 query-token columns, K \\+ 1 = 4 expected"):
        AdaptivePlanner(c, k=3, max_tokens=64)


def test_the_fast_drafters_confidences_are_the_oracles(oracle, monkeypatch, drafting_pays):
    """Every survival curve the engine plans with equals the oracle's DSpark block's (greedy), up to the first
    draft where the oracle's own top-2 margin is a near-tie."""
    seen = []
    real = spec_decode.SpecDecoder.draft

    def record(self, seqs, table_rows):
        rows = real(self, seqs, table_rows)
        seen.extend((list(s.prompt_token_ids) + list(s.output_token_ids), s.draft_survival.copy()) for s in seqs)
        return rows

    monkeypatch.setattr(spec_decode.SpecDecoder, "draft", record)
    adaptive_llm(5, max_num_seqs=2).generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10,
                                                                         ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 6
    for tokens, got in seen:
        cache = oracle.new_cache()
        oracle.forward_chunk(torch.tensor(tokens[:-1]), cache)
        block = oracle.draft(cache, anchor=tokens[-1])
        want = survivals(block.confidence.double()[None])[0]
        top2 = block.logits.topk(2, dim=-1).values
        near = ((top2[:, 0] - top2[:, 1]) / block.logits.norm(dim=-1) < 2e-4).nonzero()
        upto = int(near[0, 0]) + 1 if len(near) else len(want)  # s_t reads drafts < t
        np.testing.assert_allclose(got[:upto], want[:upto], rtol=1e-3, atol=1e-5)


def test_adaptive_greedy_speculation_gives_the_oracles_tokens_with_the_measured_profile(oracle):
    llm = adaptive_llm(5, max_num_seqs=4)
    check_against_oracle(oracle, llm, PROMPTS, 24)
    c = llm.engine.executor.runner.verify_costs
    assert c.verify_s.shape == (len(c.sizes), 6) and (c.verify_s > 0).all() and (c.draft_s > 0).all()
    assert not c.uniform  # the CPU runs eager: per-request prefixes


def test_adaptive_speculation_verifies_shorter_prefixes_and_counts_them(oracle, monkeypatch):
    """A profile where every verified draft costs 0.4 of a plain step makes only confident drafts worth it:
    prefixes shorten, the counts say so (verified_per_position non-increasing, summing to the draft tokens), and
    greedy tokens stay the oracle's."""
    steep = costs([[1.0, 1.4, 1.8, 2.2, 2.6, 3.0]] * 3, [0.0] * 3)
    monkeypatch.setattr(model_runner, "measure_costs", lambda runner, k: steep)
    llm = adaptive_llm(5, max_num_seqs=4)
    check_against_oracle(oracle, llm, PROMPTS, 32)
    stats = llm.engine.spec_decode_stats()
    v = stats.verified_per_position
    assert v == sorted(v, reverse=True) and 0 < v[-1] < v[0] and stats.num_draft_tokens == sum(v)
    assert stats.num_accepted_tokens > 0


@pytest.mark.slow  # ~160 s on 2 cores; the greedy adaptive tests stay in CI
def test_seeded_sampled_adaptive_speculation_completes_with_consistent_counts():
    llm = adaptive_llm(4, max_num_seqs=4)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=20, ignore_eos=True) for s in range(4)]
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        o = out.outputs[0]
        assert len(o.token_ids) == 20 and all(0 <= t < llm.engine.executor.cfg.vocab_size for t in o.token_ids)
        v = o.spec_decode.verified_per_position
        assert v == sorted(v, reverse=True) and o.spec_decode.num_draft_tokens == sum(v)


@pytest.mark.timeout(600)
def test_adaptive_speculation_over_two_tp_ranks_profiles_on_every_rank(oracle):
    """Every rank runs the start-up profile (its steps hold all-reduces, so the ranks must run the same ones in the
    same order); rank 0 plans; greedy output is the oracle's."""
    spec = {"num_speculative_tokens": 3, "enable_adaptive_verification": True}
    with LLM(None, speculative_config=spec, max_num_seqs=2, tensor_parallel_size=2, all_reduce_backend="host") as llm:
        assert llm.engine.executor.runner.verify_costs.verify_s.shape[1] == 4
        check_against_oracle(oracle, llm, PROMPTS[:2], 24)


def test_sampled_drafts_plan_from_their_previous_block_and_argmax_drafts_from_this_one(monkeypatch, drafting_pays):
    """The wiring of the exactness argument: a sampled request's estimate is its previous block's survivals (None
    before its first block), never the block being decided on; a greedy request's is the current one."""
    from v41.engine.adaptive_verify import AdaptivePlanner as Planner

    calls = []
    real_draft, real_plan = spec_decode.SpecDecoder.draft, Planner.plan

    def draft(self, seqs, table_rows):
        calls.append({"before": [None if s.draft_survival is None else s.draft_survival.copy() for s in seqs],
                      "greedy": [s.sampling.params.is_greedy for s in seqs]})
        return real_draft(self, seqs, table_rows)

    def plan(self, current, own, keys):
        calls[-1].update(current=current.copy(), own=[None if o is None else o.copy() for o in own])
        return real_plan(self, current, own, keys)

    monkeypatch.setattr(spec_decode.SpecDecoder, "draft", draft)
    monkeypatch.setattr(Planner, "plan", plan)
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    adaptive_llm(3, max_num_seqs=2).generate(PROMPTS[:2], params, use_tqdm=False)
    planned = [c for c in calls if "current" in c and len(c["greedy"]) == 2]
    assert len(planned) >= 3
    for c in planned:
        for r, greedy in enumerate(c["greedy"]):
            want = c["current"][r] if greedy else c["before"][r]
            got = c["own"][r]
            assert (got is None and want is None) or np.array_equal(got, want), (r, greedy)


def test_where_plain_decoding_wins_the_engine_runs_no_draft_pass(oracle, monkeypatch):
    plain_wins = costs([[1.0, 9.0, 9.0, 9.0, 9.0, 9.0]] * 3, [0.5] * 3)
    monkeypatch.setattr(model_runner, "measure_costs", lambda runner, k: plain_wins)
    llm = adaptive_llm(5, max_num_seqs=4)
    passes = []
    real = llm.engine.executor.draft
    llm.engine.executor.draft = lambda *a: passes.append(1) or real(*a)
    check_against_oracle(oracle, llm, PROMPTS[:2], 16)
    assert passes == [] and llm.engine.spec_decode_stats().num_drafts == 0
