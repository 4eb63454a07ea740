"""The engine (Rust scheduler + paged runner + sampler) gives the reference model's answers (issue: engine).

Exact-token comparisons follow the margin rule of docs/numerics.md §4 (see engine_helpers)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_same_tokens, reference_greedy
from v41.engine.llm import LLM
from v41.engine.params import SamplingParams
from v41.models.reference import load
from v41.testing.tiny import make_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["deepseek_v41", "deepseek_v4"])
def ckpt(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def ref(ckpt):
    return load(ckpt)


def engine(ckpt, **kw) -> LLM:
    kw.setdefault("block_size", 16)
    kw.setdefault("kv_cache_bytes", 32 << 20)
    return LLM(str(ckpt), **kw)


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [[0] + torch.randint(3, 1000, (t - 1,), generator=g).tolist() for t in lens]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    llm.engine.scheduler.reset_prefix_cache()
    for name, pool in llm.engine.stats()["blocks"].items():
        assert pool["used"] == 0, (name, pool)
    llm.engine.scheduler.check_invariants()


@pytest.mark.parametrize("length", [1, 7, 8, 9, 15, 16, 17, 33, 40])
def test_single_request_greedy_matches_reference_across_boundaries(ckpt, ref, length):
    llm = engine(ckpt)
    prompt = prompts(1, length, length, seed=length)[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    want, tie = reference_greedy(ref, prompt, GREEDY.max_tokens)
    assert_same_tokens(out.outputs[0].token_ids, want, tie)
    assert out.outputs[0].finish_reason == "length"
    assert_all_blocks_free(llm)


def test_concurrent_requests_get_the_tokens_they_get_alone(ckpt):
    """16 requests, mixed lengths and sampling (greedy, seeded, penalized), staggered arrival, small budget."""
    ps = prompts(16, 3, 45, seed=7)
    params = []
    for i in range(16):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=6 + i % 5, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=8, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.7, top_k=20, seed=200 + i, repetition_penalty=1.1,
                                         max_tokens=7, ignore_eos=True))
    alone = []
    for p, sp in zip(ps, params):
        alone.append(engine(ckpt).generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids)
    llm = engine(ckpt, max_num_batched_tokens=24, max_num_seqs=6)
    core = llm.engine
    results = {}
    pending = list(range(16))
    step = 0
    while pending or core.has_unfinished():
        if pending and step % 2 == 0:  # staggered arrival: two new requests every other step
            for i in pending[:2]:
                core.add_request(f"r{i}", ps[i], params[i])
            pending = pending[2:]
        for out in core.step():  # deltas: add up each request's new tokens
            results.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        step += 1
    for i in range(16):
        assert results[f"r{i}"] == alone[i], f"request {i} differs batched vs alone"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_chunked_prefill_gives_the_same_tokens_and_logprobs(ckpt, chunk):
    prompt = prompts(1, 41, 41, seed=3)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
    whole = engine(ckpt, max_num_batched_tokens=256).generate([prompt], sp, use_tqdm=False)[0]
    llm = engine(ckpt, max_num_batched_tokens=256, long_prefill_token_threshold=chunk)
    part = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert part.outputs[0].token_ids == whole.outputs[0].token_ids
    for a, b in zip(part.outputs[0].logprobs, whole.outputs[0].logprobs):
        for tok in b:
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("shared", [16, 33] + [pytest.param(n, marks=pytest.mark.slow) for n in (17, 24, 31, 32)])
def test_prefix_cache_hit_equals_cold_run(ckpt, shared):
    """A second prompt sharing `shared` tokens (hits end on page, ratio and window boundaries) gives the
    cold run's tokens; repeating the same prompt gives identical output (KF-08)."""
    base = prompts(1, 48, 48, seed=11)[0]
    other = base[:shared] + prompts(1, 12, 12, seed=12)[0][1:]
    cold = [engine(ckpt, enable_prefix_caching=False).generate([p], GREEDY, use_tqdm=False)[0]
            for p in (base, other)]
    llm = engine(ckpt)
    first = llm.generate([base], GREEDY, use_tqdm=False)[0]
    repeats = [llm.generate([base], GREEDY, use_tqdm=False)[0] for _ in range(3)]
    second = llm.generate([other], GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == cold[0].outputs[0].token_ids
    for r in repeats:
        assert r.outputs[0].token_ids == cold[0].outputs[0].token_ids
        assert r.num_cached_tokens > 0
    assert second.outputs[0].token_ids == cold[1].outputs[0].token_ids
    assert second.num_cached_tokens == shared // 16 * 16 or second.num_cached_tokens <= shared
    assert_all_blocks_free(llm)


def test_preemption_and_resume_give_identical_tokens(ckpt):
    ps = prompts(6, 30, 45, seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    roomy = engine(ckpt).generate(ps, sp, use_tqdm=False)
    llm = engine(ckpt, num_kv_blocks=6, max_num_seqs=6)  # the longest request alone needs 5 blocks per kind
    tight = llm.generate(ps, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    assert llm.engine.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def test_bad_requests_raise_clear_errors_and_leak_nothing(ckpt):
    llm = engine(ckpt, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[0] * 70], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[0, 5]], SamplingParams(max_tokens=0), use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate([[0, 5000]], GREEDY, use_tqdm=False)
    assert llm.generate([[0, 5, 6]], GREEDY, use_tqdm=False)[0].finished
    assert_all_blocks_free(llm)


def test_start_up_logs_cache_bytes_per_token_and_the_longest_request(ckpt, caplog):
    """The start-up line names every kind's bytes per token (rows over owning layers, compressed kinds per
    entry) and the longest request the cache holds alone: every block of the smallest pool, window kinds
    excepted, at the tiny model's 4,096-token limit or below."""
    import math
    import re

    caplog.set_level("INFO", logger="v41.engine")
    llm = engine(ckpt, kv_cache_bytes=4 << 20)
    core = llm.engine
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache (float32)"))
    layout = core.layout
    for k in layout.kinds:
        per = len(k.layers) * math.prod(k.row_shape) * 4 / k.tokens_per_entry
        assert f"{k.name} {per:,.0f} B" in line, (k.name, line)
    longest = int(re.search(r"fits alone: (\d+) tokens", line).group(1))
    assert core.max_model_len <= longest <= core.cfg.max_position_embeddings
    assert longest <= core.num_blocks * layout.block_tokens + 1  # the last output token is never fed
