"""``async_output_proc`` (engine/core.py, engine/commit.py): a step's tokens are detokenized and reported by the next
step call; with ``async_scheduling`` (engine/pending.py) each step is also planned and launched before the previous
step's ids reach the host. The outputs must be exactly those of the synchronous engine — token ids, text, finish and
stop reasons, logprobs — with stop strings, stop ids, EOS, ``max_tokens``, ``n`` > 1, prompt logprobs, penalties,
``min_tokens``, prefix hits and preemption (the tiny V4.1 has Engram layers: their rows of pending ids are hashed
on the device); every request ends with one terminal output, and no block leaks."""

from __future__ import annotations

import pytest
import torch

from v41.engine.args import EngineArgs
from v41.engine.core import EngineCore
from v41.engine.params import SamplingParams
from v41.testing.tiny import make_tiny


@pytest.fixture(scope="module", params=["deepseek_v41", "deepseek_v4"])
def ckpt(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(request.param), request.param)


def _core(ckpt, async_output: bool, scheduling: bool = True, **kw) -> EngineCore:
    kw = dict(block_size=16, kv_cache_bytes=32 << 20, max_num_seqs=8) | kw
    return EngineCore(EngineArgs(model=str(ckpt), async_output_proc=async_output, async_scheduling=scheduling, **kw))


def _run(core: EngineCore, requests) -> tuple[dict, int]:
    """Every output of every step by request id (deltas in order) and the number of step calls."""
    for rid, prompt, sp in requests:
        core.add_request(rid, prompt, sp)
    outs: dict[str, list] = {rid: [] for rid, _, _ in requests}
    calls = 0
    while core.has_unfinished():
        for out in core.step():
            outs[out.request_id].append(out)
        calls += 1
        assert calls < 500
    return outs, calls


def _final(deltas) -> list[tuple]:
    """Per completion: (token ids, text, finish reason, stop reason, logprob entries as (id, rank, token) and as
    values, cumulative logprob), from deltas."""
    got: dict[int, list] = {}
    for d in deltas:
        for c in d.outputs:
            g = got.setdefault(c.index, [[], "", None, None, [], [], None])
            g[0] += list(c.token_ids)
            g[1] += c.text
            g[2], g[3] = c.finish_reason or g[2], c.stop_reason if c.finish_reason else g[3]
            for entry in c.logprobs or []:
                g[4].append(sorted((k, v.rank, v.decoded_token) for k, v in entry.items()))
                g[5].append(sorted((k, v.logprob) for k, v in entry.items()))
            g[6] = c.cumulative_logprob
    return [tuple(got[i]) for i in sorted(got)]


def _assert_same(got: list[tuple], want: list[tuple], rid: str) -> None:
    """Exact ids, text, reasons and logprob ranks; logprob values to 1e-5 (a batch of another size — a request
    that a stop string ends stays one step longer — reorders the CPU matmul's sums)."""
    assert len(got) == len(want), rid
    for g, w in zip(got, want):
        assert g[:5] == w[:5], rid
        vals = [v for e in g[5] for _, v in e], [v for e in w[5] for _, v in e]
        assert [k for e in g[5] for k, _ in e] == [k for e in w[5] for k, _ in e], rid
        assert vals[0] == pytest.approx(vals[1], abs=1e-5), rid
        assert (g[6] is None) == (w[6] is None) and (g[6] is None or g[6] == pytest.approx(w[6], abs=1e-4)), rid


def _assert_all_same_and_released(core: EngineCore, got: dict, want: dict, requests) -> None:
    """Every request's outputs equal the synchronous engine's and end with one terminal output; nothing runs or
    waits, the scheduler is consistent and, once the prefix cache is dropped, no block is held."""
    for rid, *_ in requests:
        _assert_same(_final(got[rid]), _final(want[rid]), rid)
        assert sum(d.finished for d in got[rid]) == 1 and got[rid][-1].finished, rid
    stats = core.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    core.scheduler.check_invariants()
    core.scheduler.reset_prefix_cache()
    for name, pool in core.stats()["blocks"].items():
        assert pool["used"] == 0, (name, pool)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(3, 1000, (int(t),), generator=g).tolist() for t in torch.randint(4, 30, (n,), generator=g)]


@pytest.mark.parametrize("scheduling", [False, True], ids=["output", "scheduling"])
def test_async_output_gives_the_synchronous_outputs(ckpt, scheduling):
    sync = _core(ckpt, False)
    ps = _prompts(6, 0)
    probe, _ = _run(sync, [("probe", ps[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))])
    text = "".join(c.text for d in probe["probe"] for c in d.outputs)
    ids = [t for d in probe["probe"] for c in d.outputs for t in c.token_ids]
    stop = text[len(text) // 3: len(text) // 3 + 3]  # a stop string the greedy output hits mid-way
    assert stop
    requests = [
        ("stop-string", ps[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])),
        ("stop-id", ps[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[ids[7]])),
        ("sampled-n2", ps[1], SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=9, logprobs=2)),
        ("eos", ps[2], SamplingParams(temperature=1.0, seed=5, max_tokens=30)),
        ("short", ps[3], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)),
        ("long", ps[4], SamplingParams(temperature=0.7, seed=9, max_tokens=25, ignore_eos=True,
                                       stop=[stop], include_stop_str_in_output=True)),
    ]
    want, sync_calls = _run(sync, requests)
    core = _core(ckpt, True, scheduling)
    assert core._async_scheduling == scheduling
    got, async_calls = _run(core, requests)
    _assert_all_same_and_released(core, got, want, requests)
    assert want["stop-string"][-1].outputs[0].finish_reason == "stop"
    assert async_calls <= sync_calls + 1


def test_async_output_reports_a_step_one_call_later_and_aborts_cleanly(ckpt):
    core = _core(ckpt, True)
    core.add_request("a", _prompts(1, 1)[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    core.add_request("b", _prompts(1, 2)[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    assert core.step() == []  # the prefill's tokens are committed; their text is read by the next call
    first = core.step()
    assert {o.request_id for o in first} == {"a", "b"}
    assert all(len(o.outputs[0].token_ids) == 1 for o in first)
    aborted = core.abort_request("b")
    assert aborted is not None and aborted.finished
    seen = []
    while core.has_unfinished():
        seen += core.step()
    assert [o.request_id for o in seen if o.finished] == ["a"]
    assert all(o.request_id == "a" for o in seen)
    assert core.stats()["running"] == 0


def test_an_abort_reports_the_text_of_the_last_step(ckpt):
    """A request whose last tokens were appended but not yet read (async) is aborted: its terminal output carries
    their text, as the synchronous engine's does; a request id reused after an abort gets no stale output."""
    prompt = _prompts(1, 4)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want, _ = _run(_core(ckpt, False), [("a", prompt, sp)])
    core = _core(ckpt, True, scheduling=False)  # async scheduling reads a step's text in the call that commits it
    core.add_request("a", prompt, sp)
    core.add_request("b", _prompts(1, 5)[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    got = []
    while not core.seqs or not next(s for s in core.seqs.values() if s.request_id == "a").finished:
        got += [o for o in core.step() if o.request_id == "a"]
    got.append(core.abort_request("a"))  # finished by length, its last token unread
    _assert_same(_final(got), _final(want["a"]), "a")
    assert core.abort_request("b").finished
    core.add_request("b", _prompts(1, 6)[0], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    outs = core.step()
    assert all(o.request_id != "b" or o.outputs[0].token_ids for o in outs)  # nothing stale for the new "b"
    while core.has_unfinished():
        outs += core.step()
    assert [o.request_id for o in outs if o.finished] == ["b"]
    assert core.stats()["running"] == 0


def test_async_scheduling_with_penalties_min_tokens_prefix_hits_and_preemption(ckpt):
    """A cache small enough to preempt, prompts sharing a prefix (hits on pages that held placeholders), rows with
    penalties (their steps wait for the previous ids) beside rows without, min_tokens counting a pending token."""
    base = (_prompts(1, 7)[0] * 64)[:64]  # four pages shared by every prompt
    ps = [base + p[:12] for p in _prompts(6, 8)]
    requests = [
        ("greedy", ps[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
        ("penalty", ps[1], SamplingParams(temperature=0.8, seed=1, max_tokens=20, repetition_penalty=1.3,
                                          frequency_penalty=0.5)),
        ("min-tokens", ps[2], SamplingParams(temperature=1.0, seed=2, max_tokens=20, min_tokens=12)),
        ("sampled", ps[3], SamplingParams(temperature=0.9, seed=4, n=2, max_tokens=18, logprobs=1)),
        ("greedy-2", ps[4], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
        ("repeat", ps[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
    ]
    small = dict(num_kv_blocks=12, max_num_seqs=6, enable_prefix_caching=True)
    want, _ = _run(_core(ckpt, False, **small), requests)
    core = _core(ckpt, True, **small)
    got, _ = _run(core, requests)
    _assert_all_same_and_released(core, got, want, requests)
    assert core.stats()["num_preemptions"] > 0
    assert _final(got["repeat"]) == _final(got["greedy"])


def test_async_scheduling_aborts_a_request_whose_step_is_running(ckpt):
    core = _core(ckpt, True)
    core.add_request("a", _prompts(1, 1)[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    core.add_request("b", _prompts(1, 2)[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    outs = core.step() + core.step() + core.step()
    assert core._inflight is not None and "b" in {core.seqs[s].request_id for s in core._inflight.req_ids}
    aborted = core.abort_request("b")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    after = []
    while core.has_unfinished():
        after += core.step()
    assert [o.request_id for o in after] == ["a"] * len(after) and after[-1].finished  # nothing more of "b"
    assert sum(len(o.outputs[0].token_ids) for o in outs + after if o.request_id == "a") == 8
    assert core.stats()["running"] == 0
    core.scheduler.check_invariants()


def test_async_scheduling_commits_the_running_step_when_the_next_launch_raises(ckpt):
    """A launch that fails (e.g. out of memory in an eager prefill) still gives the running step's ids to their
    sequences and the scheduler, so no placeholder outlives the call."""
    core = _core(ckpt, True)
    core.add_request("a", _prompts(1, 1)[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        core.step()
    seq = next(iter(core.seqs.values()))
    before = len(seq.output_token_ids)

    def fail(*args, **kw):
        raise RuntimeError("launch failed")

    core.executor.execute = fail
    with pytest.raises(RuntimeError, match="launch failed"):
        core.step()
    assert len(seq.output_token_ids) == before + 1 and seq.sampling.pending == 0
    core.scheduler.check_invariants()
