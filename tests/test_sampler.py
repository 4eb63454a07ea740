"""Tests for ``v41.engine.sampler`` and ``v41.engine.params`` (KF-12 and KF-14 engine parts)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from v41.engine.params import Logprob, SamplingParams
from v41.engine.sampler import (
    Sampler,
    SamplingState,
    compute_prompt_logprobs,
    gather_logprobs,
    sampling_probs,
)

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


_KEYS = itertools.count(1000)  # distinct, fixed keys for states without a seed: runs are reproducible


def _state(prompt=(3, 4), device="cpu", **kw) -> SamplingState:
    return SamplingState.create(SamplingParams(**kw), list(prompt), seed=next(_KEYS))


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids.cpu(), minlength=vocab).double()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic, cells expecting fewer than 5 draws merged into one (the usual validity rule; it
    only lowers the degrees of freedom, so the fixed thresholds stay conservative)."""
    expected = probs.double().cpu() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    small = keep & (expected < 5)
    obs = torch.cat([counts[keep & ~small], counts[small].sum()[None]])
    exp = torch.cat([expected[keep & ~small], expected[small].sum()[None]])
    live = exp > 0
    return float(((obs[live] - exp[live]) ** 2 / exp[live]).sum())


# 0.999 quantiles of chi-square (df 3, 7): a false alarm once in a thousand seeds, and the seeds are fixed.
CHI2_999 = {3: 16.27, 7: 24.32}


# --------------------------------------------------------------------------- greedy, top-k, top-p, min-p


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_argmax_and_lowest_id_on_ties(device):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)).to(device)
    logits[4, 7] = logits[4, 9] = 100.0
    out = Sampler()(logits, [_state(temperature=0.0, device=device) for _ in range(5)])
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.sampled_token_ids[4].item() == 7
    assert out.logprobs is None


def test_top_k_1_equals_greedy_whatever_the_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 100, generator=g)
    states = [_state(temperature=t, top_k=1) for t in torch.linspace(0.1, 5.0, 64).tolist()]
    out = Sampler()(logits, states)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_argmax():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(2))
    out = Sampler()(logits, [_state(temperature=2.0, top_p=1e-6) for _ in range(64)])
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


PROBS4 = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize(
    ("kw", "kept"),
    [
        ({"top_k": 2}, [0, 1]),
        ({"top_k": 0}, [0, 1, 2, 3]),
        ({"top_k": -1}, [0, 1, 2, 3]),
        ({"top_k": 4000}, [0, 1, 2, 3]),
        ({"top_p": 0.8}, [0, 1]),
        ({"top_p": 0.81}, [0, 1, 2]),
        ({"min_p": 0.35}, [0, 1]),  # 0.35 * 0.5 = 0.175 > 0.15
        ({"min_p": 0.29}, [0, 1, 2]),
        ({"top_k": 3, "top_p": 0.9}, [0, 1, 2]),  # top-p over the top-3 renormalized
        ({"top_k": 3, "top_p": 0.75}, [0, 1]),
    ],
)
def test_filters_keep_the_expected_tokens_and_renormalize(kw, kept):
    logits = PROBS4.log()[None, :]
    probs = sampling_probs(logits, [SamplingParams(**kw)])[0]
    want = torch.zeros(4)
    want[kept] = PROBS4[kept] / PROBS4[kept].sum()
    torch.testing.assert_close(probs, want)
    # And the sampler draws only from the kept set, in proportion (seeded, loose chi-square bound).
    n = 8000
    out = Sampler()(logits.expand(n, 4), [_state(**kw) for _ in range(n)])
    assert _chi_square(_counts(out.sampled_token_ids, 4), want) < CHI2_999[3]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_sampling_frequencies_match_softmax(device, temperature):
    vocab, n = 8, 40000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(4)) * 1.5
    want = torch.softmax(logits / temperature, dim=-1)
    out = Sampler()(logits.expand(n, vocab).to(device), [_state(temperature=temperature) for _ in range(n)])
    assert _chi_square(_counts(out.sampled_token_ids, vocab), want) < CHI2_999[7]


def test_seeded_request_frequencies_over_steps_match_softmax():
    vocab, steps = 8, 4000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(6))
    st = _state(temperature=1.0, seed=123)
    sampler = Sampler()
    ids = []
    for _ in range(steps):  # each step samples the next position: a fresh keyed draw
        ids.append(sampler(logits, [st]).sampled_token_ids)
        st.output_token_ids.append(int(ids[-1]))
    ids = torch.cat(ids)
    assert _chi_square(_counts(ids, vocab), torch.softmax(logits[0], -1)) < CHI2_999[7]


# --------------------------------------------------------------------------- penalties, bias, min_tokens


def test_penalties_and_bias_match_a_hand_computation():
    raw = [2.0, -1.0, 0.5, -0.5, 1.0, 0.0, 3.0]
    st = _state(
        prompt=[0, 1, 6],
        repetition_penalty=1.5,
        frequency_penalty=0.2,
        presence_penalty=0.3,
        logit_bias={5: 2.5, 6: -4.0},
    )
    st.output_token_ids += [2, 2, 3]
    got = Sampler().penalized_logits(torch.tensor([raw]), [st])[0]
    want = [
        2.0 / 1.5,  # in the prompt, positive: divided
        -1.0 * 1.5,  # in the prompt, negative: multiplied
        0.5 / 1.5 - 0.2 * 2 - 0.3,  # output twice: repetition, then frequency x2 and presence
        -0.5 * 1.5 - 0.2 * 1 - 0.3,
        1.0,  # never seen
        2.5,  # bias only
        (3.0 - 4.0) * 1.5,  # bias first (3 - 4 = -1 < 0), then repetition multiplies
    ]
    torch.testing.assert_close(got, torch.tensor(want))


def test_frequency_and_presence_penalties_ignore_prompt_tokens():
    st = _state(prompt=[0, 0, 1], frequency_penalty=1.0, presence_penalty=1.0)
    got = Sampler().penalized_logits(torch.zeros(1, 4), [st])
    assert got.tolist() == [[0.0] * 4]


def test_logit_bias_moves_the_greedy_choice():
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0]])
    out = Sampler()(logits, [_state(temperature=0.0, logit_bias={2: 10.0})])
    assert out.sampled_token_ids.tolist() == [2]


def test_logit_bias_id_outside_the_logits_is_an_error():
    with pytest.raises(ValueError, match="logit_bias token id 9"):
        Sampler()(torch.zeros(1, 4), [_state(logit_bias={9: 1.0})])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_every_eos_and_stop_id(temperature):
    """KF-12 engine part: several EOS ids and a stop id, none before min_tokens tokens exist."""
    vocab, eos, stop_ids, min_tokens = 16, (1, 7, 9), [5], 4
    logits = torch.zeros(vocab)
    logits[[1, 7, 9, 5]] = 50.0  # the model wants to stop right away
    sampler = Sampler(eos_token_ids=eos)
    states = [
        _state(temperature=temperature, min_tokens=min_tokens, stop_token_ids=stop_ids, seed=s) for s in range(32)
    ]
    for step in range(min_tokens + 1):
        ids = sampler(logits.expand(len(states), vocab), states).sampled_token_ids.tolist()
        if step < min_tokens:
            assert not set(ids) & {*eos, *stop_ids}, (step, ids)
        else:
            assert set(ids) <= {*eos, *stop_ids}, (step, ids)
        for st, t in zip(states, ids):
            st.output_token_ids.append(t)


def test_ignore_eos_keeps_eos_sampleable_under_min_tokens_but_masks_stop_ids():
    logits = torch.zeros(1, 8)
    logits[0, 1] = 50.0
    logits[0, 5] = 60.0
    sampler = Sampler(eos_token_ids=(1,))
    st = _state(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    assert sampler(logits, [st]).sampled_token_ids.tolist() == [1]


# --------------------------------------------------------------------------- seeds and randomness (KF-14)


def _step_logits(request: int, step: int, vocab: int) -> torch.Tensor:
    """The logits a fake model gives ``request`` at ``step``, independent of the batch."""
    g = torch.Generator().manual_seed(1000 * request + step)
    return torch.randn(vocab, generator=g) * 2.0


_MIXED = [
    {"temperature": 0.0},  # A: greedy
    {"temperature": 0.8, "seed": 11},
    {"temperature": 0.8, "seed": 12, "top_k": 20},
    {"temperature": 1.3, "seed": 13, "top_p": 0.9, "min_p": 0.02},
    {"temperature": 0.8, "seed": 14, "repetition_penalty": 1.05, "presence_penalty": 0.5},
    {"temperature": 1.0},  # unseeded: a key of its own
]


def _run(requests: list[int], steps: int, device: str, order_seed: int | None) -> dict[int, list[int]]:
    """Run ``requests`` (indices into _MIXED) together; with ``order_seed`` shuffle rows and drop some each step."""
    vocab = 300
    sampler = Sampler()
    states = {r: _state(prompt=[r, 2 * r], device=device, **_MIXED[r]) for r in requests}
    rng = None if order_seed is None else torch.Generator().manual_seed(order_seed)
    pending = {r: steps for r in requests}
    while any(pending.values()):
        live = [r for r in requests if pending[r]]
        if rng is not None:
            live = [live[i] for i in torch.randperm(len(live), generator=rng).tolist()]
            keep = torch.rand(len(live), generator=rng) < 0.7  # some rows sit this step out
            live = [r for r, k in zip(live, keep.tolist()) if k] or live[:1]
        logits = torch.stack([_step_logits(r, len(states[r].output_token_ids), vocab) for r in live]).to(device)
        ids = sampler(logits, [states[r] for r in live]).sampled_token_ids.tolist()
        for r, t in zip(live, ids):
            states[r].output_token_ids.append(t)
            pending[r] -= 1
    return {r: st.output_token_ids for r, st in states.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_and_greedy_rows_are_identical_alone_and_in_any_mixed_batch(device):
    seeded = [0, 1, 2, 3, 4]
    alone = {r: _run([r], 24, device, None)[r] for r in seeded}
    for order_seed in (None, 1, 2, 3):
        batched = _run(list(range(len(_MIXED))), 24, device, order_seed)
        for r in seeded:
            assert batched[r] == alone[r], (r, order_seed)
    # The seeded rows really sample: different seeds give different streams.
    assert len({tuple(alone[r]) for r in (1, 2, 3, 4)}) == 4


def test_greedy_rows_draw_nothing_and_sampled_rows_one_keyed_vector(monkeypatch):
    import v41.engine.sampler as sampler_mod

    calls = []
    real = sampler_mod.keyed_race

    def spy(weights, seeds, positions, purpose):
        calls.append((seeds.tolist(), positions.tolist(), weights.shape[1], purpose))
        return real(weights, seeds, positions, purpose)

    monkeypatch.setattr(sampler_mod, "keyed_race", spy)
    Sampler()(torch.randn(3, 10), [_state(temperature=0.0, seed=5), _state(temperature=0.0), _state(temperature=0.0)])
    assert calls == []
    st = _state(prompt=[3, 4, 5], temperature=1.0, seed=42, top_k=3)
    Sampler()(torch.randn(2, 37), [_state(temperature=0.0), st])
    assert calls == [([42], [2], 37, 0)]  # one [V] draw keyed by (seed, position of the last known token)


def test_an_empty_batch_samples_nothing():
    assert Sampler()(torch.zeros(0, 10), []).sampled_token_ids.shape == (0,)


def test_keyed_draws_depend_on_seed_and_position_only():
    logits = torch.zeros(1, 50)
    a = [_state(prompt=[1, 2], temperature=1.0, seed=7) for _ in range(2)]
    first = [Sampler()(logits, [st]).sampled_token_ids.item() for st in a]
    assert first[0] == first[1]
    draws = set()
    for _ in range(8):  # later positions: independent draws
        a[1].output_token_ids.append(3)
        draws.add(Sampler()(logits, [a[1]]).sampled_token_ids.item())
    assert len(draws) > 1


def test_child_params_of_n_gt_1_get_distinct_reproducible_seeds():
    p = SamplingParams(n=3, seed=7, temperature=0.5)
    kids = [p.child(i) for i in range(3)]
    assert [k.seed for k in kids] == [7, 8, 9] and all(k.n == 1 for k in kids)
    assert SamplingParams(n=2).child(1).seed is None
    with pytest.raises(ValueError, match="child index"):
        p.child(3)


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_vllm_ranks_and_top_n():
    vocab = 40
    raw = torch.randn(4, vocab, generator=torch.Generator().manual_seed(8))
    states = [
        _state(temperature=0.7, seed=1, logprobs=5, repetition_penalty=1.3, logit_bias={0: 3.0}),
        _state(temperature=0.0, logprobs=0),
        _state(temperature=1.0, seed=2),  # did not ask
        _state(temperature=2.0, seed=3, logprobs=20, top_k=4),
    ]
    out = Sampler()(raw, states)
    ref = torch.log_softmax(raw, -1)
    ids = out.sampled_token_ids
    torch.testing.assert_close(out.logprobs.token_logprobs, ref.gather(1, ids[:, None])[:, 0])
    want_rank = (ref > ref.gather(1, ids[:, None])).sum(-1) + 1  # no ties in random logits
    assert out.logprobs.ranks.tolist() == want_rank.tolist()
    rows = out.row_logprobs(states, decode=lambda t: f"<{t}>")
    assert rows[2] is None
    assert list(rows[1]) == [ids[1].item()] and rows[1][ids[1].item()].rank == 1
    for i, n in ((0, 5), (3, 20)):
        top_lp, top_ids = ref[i].topk(n)
        d = rows[i]
        assert set(d) == {ids[i].item(), *top_ids.tolist()}
        assert next(iter(d)) == ids[i].item()  # the sampled token comes first
        for rank, (t, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist()), start=1):
            assert d[t].rank == rank and math.isclose(d[t].logprob, lp, rel_tol=1e-6)
            assert d[t].decoded_token == f"<{t}>"
        assert d[ids[i].item()].rank == want_rank[i].item()


def test_gather_logprobs_counts_ties_like_vllm():
    lp = torch.log_softmax(torch.tensor([[1.0, 1.0, 0.0]]), -1)
    got = gather_logprobs(lp, torch.tensor([0]), 2)
    assert got.ranks.tolist() == [2]  # vLLM: number of tokens with logprob >= the token's


def test_prompt_logprobs_score_each_next_prompt_token():
    vocab = 30
    prompt = [3, 17, 5, 5, 29]
    logits = torch.randn(len(prompt), vocab, generator=torch.Generator().manual_seed(9))
    ref = torch.log_softmax(logits, -1)
    for rows in (logits, logits[:-1]):
        got = compute_prompt_logprobs(rows, prompt, 2)
        assert len(got) == len(prompt) and got[0] is None
        for t in range(1, len(prompt)):
            d = got[t]
            tok = prompt[t]
            assert math.isclose(d[tok].logprob, ref[t - 1, tok].item(), rel_tol=1e-6)
            assert d[tok].rank == int((ref[t - 1] >= ref[t - 1, tok]).sum())
            top = ref[t - 1].topk(2).indices.tolist()
            assert [d[i].rank for i in top] == [1, 2]
    assert compute_prompt_logprobs(logits[:1], prompt[:1], 3) == [None]
    rank17 = 1 + int((ref[0] > ref[0, 17]).sum())
    assert compute_prompt_logprobs(logits[:2], prompt[:2], 0)[1] == {17: Logprob(ref[0, 17].item(), rank17)}
    with pytest.raises(ValueError, match="do not match"):
        compute_prompt_logprobs(logits[:2], prompt, 1)


def test_sampler_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="do not match 2 sampling rows"):
        Sampler()(torch.zeros(3, 4), [_state(), _state()])


# --------------------------------------------------------------------------- params validation


def test_default_params_follow_vllm_and_validate():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, -1, 0.0, 16, 0)
    assert (p.repetition_penalty, p.seed, p.stop, p.stop_token_ids, p.logprobs, p.logit_bias) == (
        1.0, None, None, None, None, None,
    )
    assert p.skip_special_tokens and p.spaces_between_special_tokens and not p.ignore_eos
    p.validate(1024)
    assert SamplingParams(stop="x").stop_strings == ["x"] and p.stop_strings == [] and p.stop_token_id_list == []
    assert SamplingParams(temperature=0).is_greedy and not p.is_greedy
    SamplingParams(max_tokens=None, top_k=0, logprobs=20, prompt_logprobs=0, seed=-1).validate(1024)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"n": 0}, "n must be"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {1024: 1.0}}, "logit_bias token id 1024"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id -1"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {5: float("inf")}}, r"logit_bias\[5\]"),
        ({"stop_token_ids": [1024]}, "stop_token_ids"),
        ({"stop": ["a", ""]}, "empty string"),
        ({"stop": [1]}, "stop must be"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_params_raise_a_clear_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate(1024)


def test_sampling_inputs_pack_each_row_and_grow_past_their_capacity():
    from v41.engine.sampling_inputs import TOP_P_OFF, SamplingInputs

    inputs = SamplingInputs("cpu", capacity=2)
    params = [SamplingParams(temperature=0.5 + i, top_k=i, top_p=1.0 if i % 2 else 0.5, min_p=0.01 * i)
              for i in range(5)]
    rows = inputs.load(params, [4, 3, 2, 1, 0], [10, 11, 12, 13, 14], [7, 8, 9, 10, 11], vocab=3)
    assert inputs.capacity >= 5
    assert rows.index.tolist() == [4, 3, 2, 1, 0] and rows.seed.tolist() == [10, 11, 12, 13, 14]
    assert rows.position.tolist() == [7, 8, 9, 10, 11]
    assert rows.top_k.tolist() == [3, 1, 2, 3, 3]  # 0 and k >= vocab: off (= vocab)
    assert rows.top_p.tolist() == [0.5, TOP_P_OFF, 0.5, TOP_P_OFF, 0.5]
    torch.testing.assert_close(rows.temperature, torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5]))
    assert rows.use_top_k and rows.use_top_p and rows.use_min_p
    rows = inputs.load(params[1:2], [0], [1], [2], vocab=3)
    assert rows.top_k.tolist() == [1] and not rows.use_top_p and rows.use_min_p


def test_top_p_and_min_p_that_round_away_in_float32_still_apply():
    """A top_p just below 1 / a tiny min_p (1.0 / 0.0 in float32) still run their step (found by a fuzz of the
    pinned-buffer sampler against the list-built one)."""
    import math

    logits = torch.full((1, 50000), float("-inf"))
    logits[0, 36997] = 0.0
    logits[0, 24046] = math.log(2.5e-8)
    st = SamplingState.create(SamplingParams(temperature=1.0, top_p=0.99999998, seed=66), [0])
    assert Sampler()(logits, [st]).sampled_token_ids.tolist() == [36997]
    st = SamplingState.create(SamplingParams(temperature=1.0, min_p=1e-46, seed=15), [0])
    assert Sampler()(torch.tensor([[0.0, 0.19822204113006592, -0.7]]), [st]).sampled_token_ids.tolist() == [0]


def test_keyed_uniforms_stay_below_one_so_a_masked_token_never_wins():
    """(x >> 8 = 2^24 − 1) gave u = 1.0 in float32, q = −log u = 0, and a −inf token's 0/0 = NaN won argmax."""
    from v41.kernels.sampling import PURPOSE_SAMPLE, uniforms_ref

    u = uniforms_ref(torch.tensor([810476]), torch.tensor([0]), 8, PURPOSE_SAMPLE)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    st = SamplingState.create(SamplingParams(temperature=1.0, top_k=1, seed=810476), [7])
    logits = torch.tensor([[5.0, 4.0, float("-inf"), 3.0, 2.0, 1.0, 0.0, -1.0]])
    assert Sampler()(logits, [st]).sampled_token_ids.tolist() == [0]
