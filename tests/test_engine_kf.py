"""Known failures of other engines, at the engine level (docs/known-failures.md KF-08..KF-14), plus n > 1 and
AsyncEngine streaming/abort."""

from __future__ import annotations

import asyncio
import time

import pytest

from test_engine import assert_all_blocks_free, engine, prompts
from v41.engine.async_engine import AsyncEngine
from v41.engine.params import SamplingParams
from v41.testing.tiny import make_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("v41"), "deepseek_v41")


def test_kf09_many_cached_prefixes_with_one_new_token_in_one_step(ckpt):
    """Each request has a long cached prefix and one new token, all scheduled in one step: each gets its
    cold stand-alone token."""
    ps = prompts(8, 40, 48, seed=21)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    cold = [engine(ckpt, enable_prefix_caching=False).generate([p], one, use_tqdm=False)[0].outputs[0].token_ids
            for p in ps]
    llm = engine(ckpt, max_num_batched_tokens=4096)
    for p in ps:  # warm the prefix cache with every prompt minus its last token
        llm.generate([p[:-1]], one, use_tqdm=False)
    got = llm.generate(ps, one, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == cold
    assert all(o.num_cached_tokens >= 32 for o in got)
    assert_all_blocks_free(llm)


def test_kf10_prompt_logprobs_after_a_prefix_hit_equal_the_cold_run(ckpt):
    p1 = prompts(1, 48, 48, seed=22)[0]
    p2 = p1[:36] + prompts(1, 13, 13, seed=23)[0][1:]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    cold = engine(ckpt, enable_prefix_caching=False).generate([p2], sp, use_tqdm=False)[0].prompt_logprobs
    llm = engine(ckpt)
    llm.generate([p1], sp, use_tqdm=False)
    warm = llm.generate([p2], sp, use_tqdm=False)[0].prompt_logprobs
    assert len(warm) == len(p2) and warm[0] is None
    for a, b in zip(warm[1:], cold[1:]):
        assert a is not None and set(a) == set(b)
        for tok in b:
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-3
    assert_all_blocks_free(llm)


def _stream(llm_ckpt, prompt, params):
    eng = AsyncEngine(model=str(llm_ckpt), block_size=16, kv_cache_bytes=32 << 20)

    async def run():
        deltas = []
        async for out in eng.generate(prompt, params):
            deltas.append(out)
        return deltas

    try:
        return asyncio.run(run())
    finally:
        eng.shutdown()


def test_kf11_stop_string_is_never_streamed_before_it_completes(ckpt):
    prompt = "Here is the English alphabet: ABC"
    full = engine(ckpt).generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].text
    cut = len(full) // 3
    stop = full[cut:cut + 6]
    assert len(stop) == 6 and stop not in full[:cut]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    deltas = _stream(ckpt, prompt, sp)
    text = "".join(d.outputs[0].text for d in deltas)
    assert text == full[:cut]
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "stop"
    assert deltas[-1].outputs[0].stop_reason == stop
    offline = engine(ckpt).generate([prompt], sp, use_tqdm=False)[0].outputs[0].text
    assert offline == text


def test_kf12_min_tokens_masks_every_eos_id(ckpt):
    llm = engine(ckpt)
    eos = llm.engine.cfg.eos_token_ids
    assert len(eos) >= 2
    bias = {t: 100.0 for t in eos}  # EOS would win every step without the mask
    sp = SamplingParams(temperature=0.0, min_tokens=32, max_tokens=64, logit_bias=bias)
    out = llm.generate([prompts(1, 10, 10, seed=24)[0]], sp, use_tqdm=False)[0].outputs[0]
    assert not set(out.token_ids[:32]) & set(eos)
    assert len(out.token_ids) == 33 and out.token_ids[-1] in eos and out.finish_reason == "stop"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("variant", ["plain", "n2", "logprobs"])
def test_kf13_max_tokens_one_next_to_a_penalized_request(ckpt, variant):
    pa, pb = prompts(2, 12, 20, seed=25)
    a = SamplingParams(temperature=0.0, max_tokens=1, n=2 if variant == "n2" else 1, seed=1,
                       logprobs=2 if variant == "logprobs" else None)
    b = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.05, ignore_eos=True)
    alone = engine(ckpt).generate([pb], b, use_tqdm=False)[0].outputs[0].token_ids
    llm = engine(ckpt)
    out_a, out_b = llm.generate([pa, pb], [a, b], use_tqdm=False)
    assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in out_a.outputs)
    assert len(out_a.outputs) == a.n
    assert out_b.outputs[0].token_ids == alone
    assert_all_blocks_free(llm)


def test_kf14_greedy_and_seeded_requests_are_batch_independent(ckpt):
    ps = prompts(5, 8, 30, seed=26)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, seed=s, max_tokens=10, ignore_eos=True) for s in (5, 6, 7, 8)]
    alone = [engine(ckpt).generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(ps, [greedy] + seeded)]
    llm = engine(ckpt)
    for _ in range(2):
        together = llm.generate(ps, [greedy] + seeded, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in together] == alone


def test_n_greater_than_one_shares_the_prompt_prefix(ckpt):
    prompt = prompts(1, 40, 40, seed=27)[0]
    sp = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6, ignore_eos=True)
    llm = engine(ckpt)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        alone = engine(ckpt).generate([prompt], sp.child(i), use_tqdm=False)[0].outputs[0].token_ids
        assert c.token_ids == alone
    assert llm.engine.stats()["prefix_hit_tokens"] >= 2 * 32
    assert_all_blocks_free(llm)


def test_async_stream_deltas_concatenate_to_the_offline_result(ckpt):
    prompt = prompts(1, 20, 20, seed=28)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    deltas = _stream(ckpt, prompt, sp)
    offline = engine(ckpt).generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert sum((d.outputs[0].token_ids for d in deltas), []) == offline.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == offline.text
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished


def test_async_abort_and_disconnect_free_everything(ckpt):
    eng = AsyncEngine(model=str(ckpt), block_size=16, kv_cache_bytes=32 << 20)
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def run():
        # a consumer that stops reading after 3 deltas (disconnect) and one aborted explicitly
        gen = eng.generate([0, 5, 6, 7], long, request_id="disc")
        n = 0
        async for _ in gen:
            n += 1
            if n == 3:
                break
        await gen.aclose()
        outs = []

        async def consume():
            async for o in eng.generate([0, 8, 9], long, request_id="ab"):
                outs.append(o)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        await eng.abort("ab")
        await asyncio.wait_for(task, timeout=30)
        return outs

    try:
        outs = asyncio.run(run())
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        deadline = time.monotonic() + 10
        while eng.core.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not eng.core.has_unfinished()
        stats = eng.core.stats()
        assert stats["running"] == 0 and stats["waiting"] == 0
    finally:
        eng.shutdown()


def test_async_bad_request_raises_value_error(ckpt):
    eng = AsyncEngine(model=str(ckpt), block_size=16, kv_cache_bytes=32 << 20)

    async def run():
        async for _ in eng.generate([], GREEDY):
            pass

    try:
        with pytest.raises(ValueError, match="empty"):
            asyncio.run(run())
        assert eng.is_running
    finally:
        eng.shutdown()
