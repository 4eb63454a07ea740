"""Per-request scheduling options of the engine (docs/serving-api.md, GenerateRequest "cache"): ``cache_salt`` keeps
prefix-cache hits inside one namespace, ``priority`` orders admission (lower first, vLLM's convention); bad
values are refused before anything is queued."""

from __future__ import annotations

import pytest
import torch

from v41.engine.llm import LLM
from v41.engine.params import SamplingParams
from v41.testing.tiny import make_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [0] + list(range(100, 147))  # 48 tokens: three full 16-token pages


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("v41"), "deepseek_v41")


def engine(ckpt, **kw) -> LLM:
    return LLM(str(ckpt), block_size=16, kv_cache_bytes=32 << 20, **kw)


def run(llm: LLM, **options):
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False, **options)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_cache_salt_shares_prefix_blocks_only_within_one_salt(ckpt):
    llm = engine(ckpt)
    tokens, cached = run(llm, cache_salt="alice")
    assert cached == 0
    assert run(llm, cache_salt="bob") == (tokens, 0)  # another tenant: no hit on alice's blocks
    assert run(llm) == (tokens, 0)  # the default namespace is a namespace of its own
    hits = [run(llm, cache_salt=s) for s in ("alice", "bob", None)]
    assert all(t == tokens and c >= 32 for t, c in hits), hits


def test_a_prompt_dict_carries_its_own_salt_as_in_vllm(ckpt):
    llm = engine(ckpt)
    salted = [{"prompt_token_ids": PROMPT, "cache_salt": s} for s in ("dict-a", "dict-b", "dict-a")]
    outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in salted]  # one after the other
    assert [o.num_cached_tokens for o in outs[:2]] == [0, 0] and outs[2].num_cached_tokens >= 32
    assert run(llm, cache_salt="dict-b")[1] >= 32  # the argument and the dict name the same namespace
    with pytest.raises(ValueError, match="cache_salt given twice"):
        llm.generate([salted[0]], GREEDY, use_tqdm=False, cache_salt="other")
    with pytest.raises(ValueError, match=r"unknown prompt dict key\(s\) \['salt'\]"):
        llm.generate([{"prompt_token_ids": PROMPT, "salt": "x"}], GREEDY, use_tqdm=False)


def test_cache_salt_with_n_and_prompt_logprobs(ckpt):
    llm = engine(ckpt)
    llm.generate([PROMPT], GREEDY, use_tqdm=False, cache_salt="a")
    both = llm.generate([PROMPT], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3), use_tqdm=False,
                        cache_salt="a")[0]
    assert both.num_cached_tokens >= 32 and len(both.outputs) == 2
    scored = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False,
                          cache_salt="a")[0]
    assert len(scored.prompt_logprobs) == len(PROMPT)  # every position computed: no hit under prompt logprobs
    assert llm.engine.stats()["running"] == 0


def test_priority_orders_admission_lower_first_then_arrival(ckpt):
    llm = engine(ckpt, max_num_seqs=1)
    core = llm.engine
    for rid, prio in [("late-low", 5), ("first-high", -3), ("mid-a", 1), ("mid-b", 1)]:
        core.add_request(rid, PROMPT[:20], GREEDY, priority=prio)
    finished = []
    while core.has_unfinished():
        finished += [o.request_id for o in core.step() if o.finished]
    assert finished == ["first-high", "mid-a", "mid-b", "late-low"]


def test_llm_takes_one_priority_per_prompt(ckpt, monkeypatch):
    llm = engine(ckpt, max_num_seqs=1)
    order, step = [], llm.engine.step

    def recording_step():
        outs = step()
        order.extend(o.request_id for o in outs if o.finished)
        return outs

    monkeypatch.setattr(llm.engine, "step", recording_step)
    outs = llm.generate([PROMPT[:10], PROMPT[:12], PROMPT[:14]], GREEDY, use_tqdm=False, priority=[1, 0, 1])
    assert order == [outs[1].request_id, outs[0].request_id, outs[2].request_id]
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.generate([PROMPT[:10], PROMPT[:12]], GREEDY, use_tqdm=False, priority=[1])


@pytest.mark.parametrize("options, message", [
    ({"priority": 2**31}, "priority must be an integer"),
    ({"priority": -2**31 - 1}, "priority must be an integer"),
    ({"priority": "1"}, "priority must be an integer"),
    ({"priority": True}, "priority must be an integer"),
    ({"priority": 1.0}, "priority must be an integer"),
    ({"priority": None}, "priority must be an integer"),
    ({"cache_salt": 7}, "cache_salt must be a string"),
    ({"cache_salt": ""}, "cache_salt must be a non-empty string"),
    ({"cache_salt": "tenant-\ud800"}, "cache_salt must be valid UTF-8 text: .* at character 7"),
])
def test_bad_options_are_refused_and_queue_nothing(ckpt, options, message):
    llm = engine(ckpt)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT], GREEDY, use_tqdm=False, **options)
    assert not llm.engine.requests and llm.engine.stats()["waiting"] == 0
    assert run(llm)[1] == 0  # the engine still serves


def test_n_is_bounded_by_the_engines_max_n(ckpt):
    llm = engine(ckpt, max_n=3)
    assert len(llm.generate([PROMPT], SamplingParams(n=3, max_tokens=1), use_tqdm=False)[0].outputs) == 3
    with pytest.raises(ValueError, match=r"n must be at most 3 \(the engine's max_n"):
        llm.generate([PROMPT], SamplingParams(n=4, max_tokens=1), use_tqdm=False)
    assert not llm.engine.requests and llm.engine.stats()["waiting"] == 0
    with pytest.raises(ValueError, match="max_n must be positive"):
        engine(ckpt, max_n=0)


@pytest.mark.slow  # ~190 s on 2 cores
def test_a_preempted_request_reports_only_its_first_admissions_prefix_hit(ckpt):
    """Re-admitted after preemption, a request hits its own pages: that is no prefix-cache hit to report."""
    g = torch.Generator().manual_seed(1)
    prompts = [[0] + torch.randint(3, 1000, (39,), generator=g).tolist() for _ in range(2)]  # unrelated
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    roomy = engine(ckpt).generate(prompts, sp, use_tqdm=False)
    llm = LLM(str(ckpt), block_size=16, kv_cache_bytes=32 << 20, num_kv_blocks=6, max_num_seqs=2)
    tight = llm.generate(prompts, sp, use_tqdm=False, priority=[5, -5])
    assert llm.engine.stats()["num_preemptions"] > 0  # the priority-5 request was preempted and re-admitted
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    assert [o.num_cached_tokens for o in tight] == [0, 0]


def test_async_engine_without_a_model_serves_the_embedded_one_like_llm():
    import asyncio

    from v41.engine.async_engine import AsyncEngine

    engine = AsyncEngine(kv_cache_bytes=8 << 20)
    try:
        async def run():
            return [o async for o in engine.generate([0, 5, 6], GREEDY)]

        assert asyncio.run(run())[-1].finished
        assert engine.core.args.model == LLM(kv_cache_bytes=8 << 20).engine.args.model
    finally:
        engine.shutdown()
