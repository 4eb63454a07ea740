"""DSpark speculative decoding in the engine (issue 15; docs/speculative-decoding.md §6): greedy speculation gives
the oracle's greedy tokens whatever the draft length, chunking, prefix hits and preemption, and the engine's
drafts are the reference drafter's."""

from __future__ import annotations


import pytest
import torch

from v41.engine.llm import LLM
from v41.engine.params import SamplingParams
from v41.models.reference import loader
from v41.testing.embedded import embedded_model_dir

from engine_helpers import assert_same_tokens, reference_greedy

PROMPTS = ["def main(args):\n    ", "import os\nimport sys\n\n", "The scheduler plans one step", "class Foo:\n"]


@pytest.fixture(scope="module")
def oracle():
    return loader.load(embedded_model_dir())


def spec_llm(k: int, **kwargs) -> LLM:
    return LLM(None, speculative_config={"method": "dspark", "num_speculative_tokens": k}, **kwargs)


_ORACLE_RUNS: dict[tuple, tuple[list[int], int]] = {}


def check_against_oracle(oracle, llm: LLM, prompts: list[str], max_tokens: int) -> None:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    for out in outs:
        key = (tuple(out.prompt_token_ids), max_tokens)
        if key not in _ORACLE_RUNS:  # the oracle decodes token by token: once per prompt for the whole module
            _ORACLE_RUNS[key] = reference_greedy(oracle, list(out.prompt_token_ids), max_tokens)
        want, tie = _ORACLE_RUNS[key]
        assert_same_tokens(list(out.outputs[0].token_ids), want, tie)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_gives_the_oracles_tokens(oracle, k):
    check_against_oracle(oracle, spec_llm(k, max_num_seqs=4), PROMPTS, 32)


def test_greedy_speculation_with_processors_gives_the_plain_engines_tokens():
    """Greedy requests with a repetition penalty or min_tokens verify through the processed target rows, the
    others through the raw argmax: in one batch, each request gets the plain engine's greedy tokens."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=24, min_tokens=12),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.7),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    plain = LLM(None, max_num_seqs=4).generate(PROMPTS, params, use_tqdm=False)
    spec = spec_llm(3, max_num_seqs=4).generate(PROMPTS, params, use_tqdm=False)
    for p, s in zip(plain, spec):
        assert list(s.outputs[0].token_ids) == list(p.outputs[0].token_ids)
    assert len(set(tuple(p.outputs[0].token_ids) for p in plain)) == 4


def test_speculation_under_preemption_gives_the_plain_engines_tokens():
    """A pool so small that speculating requests are preempted and recompute (their drafter rings included):
    each still gets the plain engine's greedy tokens (CI's share of the slow test below, which checks the
    oracle and adds chunked prefill and prefix hits)."""
    base = "def load(path):\n    with open(path) as f:\n        return f.read()\n\n"
    prompts = [base + "def save(", base + "class Store:\n", base + "import json\n"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(None, max_num_seqs=3).generate(prompts, sp, use_tqdm=False)
    small = spec_llm(5, max_num_seqs=3, num_kv_blocks=10, block_size=8)  # one request needs 9 blocks per kind
    spec = small.generate(prompts, sp, use_tqdm=False)
    assert small.engine.stats()["num_preemptions"] > 0
    for p, q in zip(plain, spec):
        assert list(q.outputs[0].token_ids) == list(p.outputs[0].token_ids)


def test_speculation_over_fp8_records_gives_the_plain_fp8_engines_tokens():
    """With --kv-cache-dtype fp8 the verify steps write the window, compressed and index records and the drafter's
    context rings as records too; rolled-back positions are rewritten: the tokens are the plain engine's."""
    prompts = ["def load(path):\n    with open(path) as f:\n", "class Store:\n    def __init__(self"]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(None, kv_cache_dtype="fp8").generate(prompts, sp, use_tqdm=False)
    llm = spec_llm(4, kv_cache_dtype="fp8")
    assert llm.engine.layout.kind("dspark").record is not None
    for p, q in zip(plain, llm.generate(prompts, sp, use_tqdm=False)):
        assert list(q.outputs[0].token_ids) == list(p.outputs[0].token_ids)


@pytest.mark.slow  # ~300 s on 2 cores; CI runs test_speculation_under_preemption_gives_the_plain_engines_tokens
def test_speculation_with_chunked_prefill_prefix_hits_and_preemption(oracle):
    """Chunks of 7 tokens (the verify rows share the budget), a shared prefix computed once, and a pool so small
    that requests are preempted and recompute (their drafter rings included)."""
    base = "def load(path):\n    with open(path) as f:\n        return f.read()\n\n"
    prompts = [base + "def save(", base + "class Store:\n", base + "import json\n"]
    llm = spec_llm(5, max_num_seqs=3, max_num_batched_tokens=7, long_prefill_token_threshold=7, block_size=8)
    check_against_oracle(oracle, llm, prompts[:1], 24)
    check_against_oracle(oracle, llm, prompts[1:], 24)  # hits the first prompt's cached blocks
    assert llm.engine.stats()["prefix_hit_rate"] > 0
    small = spec_llm(5, max_num_seqs=3, num_kv_blocks=10, block_size=8)  # one request needs 9 blocks per kind
    check_against_oracle(oracle, small, prompts, 32)
    assert small.engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_engine_drafts_are_the_reference_drafters(oracle, monkeypatch, kv):
    """Every draft block the engine proposes equals the oracle's DSpark block (greedy) for the committed prefix,
    up to a slot where the oracle's own top-2 margin is a near-tie. With fp8 records the oracle rounds its window
    rows (the drafter's rings and block rows included) through their cache format: its attention modules'
    ``deployed`` flag."""
    from v41.engine import spec_decode
    from v41.models.reference.attention import Attention

    if kv == "fp8":
        oracle = loader.load(embedded_model_dir())
        for m in oracle.modules():
            if isinstance(m, Attention):
                m.deployed = True

    seen = []
    real = spec_decode.SpecDecoder.draft

    def record(self, seqs, table_rows):
        rows = real(self, seqs, table_rows)
        seen.extend((list(s.prompt_token_ids) + list(s.output_token_ids), r) for s, r in zip(seqs, rows))
        return rows

    monkeypatch.setattr(spec_decode.SpecDecoder, "draft", record)
    spec_llm(5, max_num_seqs=2, kv_cache_dtype=kv).generate(
        PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 6
    for tokens, drafts in seen:
        cache = oracle.new_cache()
        oracle.forward_chunk(torch.tensor(tokens[:-1]), cache)
        block = oracle.draft(cache, anchor=tokens[-1])
        want = block.tokens.tolist()[: len(drafts)]
        for i, (got, ref) in enumerate(zip(drafts, want)):
            if got != ref:
                top2 = block.logits[i].topk(2).values
                assert (top2[0] - top2[1]) / block.logits[i].norm() < 2e-4, (tokens, drafts, want)
                break


@pytest.mark.parametrize("method", ["block", pytest.param("token", marks=pytest.mark.slow)])
def test_seeded_sampled_speculation_is_batch_invariant(method):
    """KF-14 under speculation (docs/speculative-decoding.md §6.6): a seeded sampled request gives the same text
    alone and beside other requests (other slots, other drafts accepted around it); another seed differs."""
    llm = LLM(None, max_num_seqs=4, speculative_config={"num_speculative_tokens": 4,
                                                        "rejection_sample_method": method})
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0]
    others = [SamplingParams(temperature=0.8, seed=s, max_tokens=20, ignore_eos=True) for s in (1, 2)]
    mixed = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3]], [others[0], sp, others[1]], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.token_ids
    assert alone.spec_decode.num_drafts > 0
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.8, top_p=0.95, seed=8, max_tokens=24,
                                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert other_seed.token_ids != alone.token_ids


def test_the_trained_drafter_is_accepted_and_counted():
    """The counts of speculative-decoding.md §5 on real drafts: a step verifies K drafts (fewer only where
    max_tokens leaves less room), the shipped drafter gets some accepted, and each verify step commits 1 + a."""
    k = 4
    out = spec_llm(k, max_num_seqs=2).generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=40,
                                                                           ignore_eos=True), use_tqdm=False)
    for o in out:
        stats = o.outputs[0].spec_decode
        v = stats.verified_per_position
        assert v[0] == stats.num_drafts and v[-1] >= stats.num_drafts - 1 and stats.num_draft_tokens == sum(v)
        assert stats.num_accepted_tokens == sum(stats.accepted_per_position) > 0
        assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)  # a prefix is accepted
        # the first token comes from the prefill; each verify step commits 1 + a (the last may be cut by max_tokens)
        assert 1 + stats.num_drafts + stats.num_accepted_tokens >= 40 > stats.num_drafts + stats.num_accepted_tokens - k


@pytest.mark.timeout(300)
@pytest.mark.parametrize("draft_tp", [2, 1])
def test_speculation_over_two_tp_ranks_gives_the_oracles_tokens(oracle, draft_tp):
    """§6.7: over TP = 2 CPU ranks the drafter's stages shard like the target's (draft TP 2) or are whole on both
    ranks (draft TP 1: no all-reduce inside them); either way greedy output is the oracle's."""
    spec = {"num_speculative_tokens": 3, "draft_tensor_parallel_size": draft_tp}
    with LLM(None, speculative_config=spec, max_num_seqs=2, tensor_parallel_size=2, all_reduce_backend="host") as llm:
        check_against_oracle(oracle, llm, PROMPTS[:2], 32)
        model = llm.engine.executor.runner.model
        experts = model.drafter.stages[0].ffn.w2.shape[2]  # the stage experts' intermediate slice
        assert experts == model.cfg.moe_intermediate_size // (2 if draft_tp == 2 else 1)


def _first_tie(out, margin: float = 2e-4) -> int:
    """The first position whose plain top-2 logprob margin is below ``margin`` (its length if none)."""
    for i, lp in enumerate(out.logprobs):
        top = sorted((v.logprob for v in lp.values()), reverse=True)
        if len(top) > 1 and top[0] - top[1] < margin:
            return i
    return len(out.token_ids)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("batch,tokens", [(1, 2000), (8, 2000), (64, 256)])
def test_long_greedy_speculation_gives_the_plain_tokens(batch, tokens):
    """§6.1 at length: 2,000 greedy tokens per request at batch 1 and 8 (256 at batch 64, for the CPU's sake), K = 5,
    equal to the plain engine's up to each request's first near-tie (the margin rule), the window rings wrapping
    hundreds of times."""
    prompts = [PROMPTS[i % len(PROMPTS)] + "#" * (i // len(PROMPTS)) for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    plain = LLM(None, max_num_seqs=batch).generate(prompts, SamplingParams(temperature=0, max_tokens=tokens,
                                                                           ignore_eos=True, logprobs=2),
                                                   use_tqdm=False)
    spec = spec_llm(5, max_num_seqs=batch).generate(prompts, sp, use_tqdm=False)
    compared = 0
    for p, s in zip(plain, spec):
        n = _first_tie(p.outputs[0])
        assert list(s.outputs[0].token_ids[:n]) == list(p.outputs[0].token_ids[:n])
        compared += n
    assert compared >= tokens // 4 * batch, compared  # most of the text is compared, not cut at a tie
    assert sum(s.outputs[0].spec_decode.num_accepted_tokens for s in spec) > 0


@pytest.mark.timeout(300)
def test_draft_ids_stay_in_the_vocabulary_over_an_uneven_tp_split(tmp_path, monkeypatch):
    """§6.8: a 1,021-id vocabulary split over 2 ranks pads the gathered logits; drafts (greedy, and sampled at
    temperature 1) and committed tokens never take a padding column."""
    from v41.engine import spec_decode
    from v41.testing.tiny import make_tiny

    path = make_tiny(tmp_path / "m", "deepseek_v41", vocab_size=1021)
    seen = []
    real = spec_decode.SpecDecoder.draft

    def record(self, seqs, table_rows):
        rows = real(self, seqs, table_rows)
        seen.extend(t for r in rows for t in r)
        return rows

    monkeypatch.setattr(spec_decode.SpecDecoder, "draft", record)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=24, ignore_eos=True) for i, t in enumerate((0, 1.0))]
    with LLM(str(path), speculative_config={"num_speculative_tokens": 3}, max_num_seqs=2, tensor_parallel_size=2,
             all_reduce_backend="host") as llm:
        outs = llm.generate([{"prompt_token_ids": [5, 77, 900]}, {"prompt_token_ids": [1020, 3]}], params,
                            use_tqdm=False)
    assert len(seen) > 20 and all(0 <= t < 1021 for t in seen)
    assert all(0 <= t < 1021 for o in outs for t in o.outputs[0].token_ids)
