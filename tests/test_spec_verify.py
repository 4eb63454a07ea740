"""Tests for ``v41.engine.spec_verify``: target rows, greedy verification, the plain sampler as the k = 0 case,
batch invariance and drafted EOS (docs/speculative-decoding.md §3, §3f). Exactness: test_spec_verify_lossless.
"""

from __future__ import annotations

import math

import pytest
import torch

from v41.engine.params import SamplingParams
from v41.engine.sampler import Sampler, SamplingState, sampling_probs
from v41.engine.spec_verify import METHODS, SpecVerifier

V, EOS = 16, 15
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


def _state(seed: int, output=(4, 9), **kw) -> SamplingState:
    return SamplingState(SamplingParams(max_tokens=None, **kw), [1, 2, 3], seed, list(output))


def _mixed_states() -> list[SamplingState]:
    """Sampled and greedy requests with every processor the target rows must apply."""
    return [
        _state(11, temperature=0.8, top_k=6, top_p=0.9, repetition_penalty=1.4, min_tokens=4,
               logit_bias={3: 1.5, EOS: 20.0}),
        _state(12, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
        _state(13, temperature=1.2, min_p=0.05, presence_penalty=0.5),
        _state(14, temperature=0.0),
        _state(15, temperature=1.0),
    ]


def _plain_row(sampler: Sampler, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """[V] what the plain sampler samples from (one-hot argmax for greedy)."""
    x = sampler.penalized_logits(logits[None], [state])
    if state.params.is_greedy:
        return torch.nn.functional.one_hot(x.argmax(-1)[0], logits.shape[-1]).float()
    return sampling_probs(x, [state.params])[0]


def _flat_logits(counts, seed=0, device="cpu") -> torch.Tensor:
    return (torch.randn(sum(counts) + len(counts), V, generator=torch.Generator().manual_seed(seed)) * 2).to(device)


def _drafts(sv: SpecVerifier, states, k: int, seed=1, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """k drafts per request from random drafter logits: ids [B, k], Q [B, k, V]."""
    g = torch.Generator().manual_seed(seed)
    b = len(states)
    ids, qs = [torch.zeros(b, 0, dtype=torch.int64, device=device)], [torch.zeros(b, 0, V, device=device)]
    for j in range(k):
        d, q = sv.draft(torch.randn(b, V, generator=g).to(device), states, [s.position for s in states], j)
        ids.append(d[:, None])
        qs.append(q[:, None])
    return torch.cat(ids, 1), torch.cat(qs, 1)


# --------------------------------------------------------------------------- target rows (§3e)


@pytest.mark.parametrize("device", DEVICES)
def test_target_rows_are_the_plain_processors_over_the_hypothesised_prefix(device):
    sampler = Sampler([EOS])
    sv = SpecVerifier(sampler)
    states, counts, k = _mixed_states(), [3, 2, 0, 1, 3], 3
    logits = _flat_logits(counts, device=device)
    drafts = torch.randint(0, V, (len(states), k), generator=torch.Generator().manual_seed(2)).to(device)
    drafts[0, 0] = 3  # a draft the repetition penalty must see in the next row
    got = sv.target_probs(logits, states, drafts, counts)
    assert got.shape == (5, k + 1, V) and got.dtype == torch.float32
    row = 0
    for r, s in enumerate(states):
        for j in range(k + 1):
            if j > counts[r]:
                assert bool((got[r, j] == 0).all())
                continue
            want = _plain_row(sampler, logits[row].cpu(), s.extended(drafts[r, :j].tolist()))
            torch.testing.assert_close(got[r, j].cpu(), want)
            row += 1
    # min_tokens counts the hypothesised drafts: request 0 has 2 outputs, so EOS is masked in rows 0-1 only.
    assert got[0, :2, EOS].eq(0).all() and got[0, 2:, EOS].gt(0).all()
    plain = [states[3], states[4]]  # no step 1-4 processor: no host copy of the drafts, same rows
    torch.testing.assert_close(sv.target_probs(logits[sum(counts[:3]) + 3:], plain, drafts[3:], counts[3:]),
                               got[3:])


def test_target_rows_reject_mismatched_shapes():
    sv = SpecVerifier(Sampler())
    states = _mixed_states()[:2]
    with pytest.raises(ValueError, match="num_drafts"):
        sv.target_probs(_flat_logits([1, 1]), states, torch.zeros(2, 1, dtype=torch.int64), [1, 2])
    with pytest.raises(ValueError, match="target logits"):
        sv.target_probs(_flat_logits([1, 0]), states, torch.zeros(2, 1, dtype=torch.int64), [1, 1])
    with pytest.raises(ValueError, match="method"):
        sv.verify("typical", torch.zeros(2, 2, V), torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 1, V), [1, 1],
                  states)


# --------------------------------------------------------------------------- greedy (§3a)


def _greedy_case(states, mismatch, k, seed=3):
    """Target logits and drafts that follow each greedy request's argmax up to draft ``mismatch[r]`` (1-based; 0 =
    none), which is argmax + 1. Returns logits, drafts, want_a, want_y."""
    sampler = Sampler([EOS])
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(states) * (k + 1), V, generator=g) * 2
    drafts = torch.randint(0, V, (len(states), k), generator=g)
    want_a, want_y = [], []
    for r, s in enumerate(states):
        a = None
        for j in range(k + 1):
            best = int(sampler(logits[r * (k + 1) + j][None], [s.extended(drafts[r, :j].tolist())]).sampled_token_ids)
            if j == k or j + 1 == mismatch[r]:
                if j < k:
                    drafts[r, j] = (best + 1) % V
                a, y = j, best
                break
            drafts[r, j] = best
        want_a.append(a)
        want_y.append(y)
    return logits, drafts, want_a, want_y


@pytest.mark.parametrize("method", METHODS)
def test_greedy_accepts_up_to_the_first_mismatch_and_emits_the_argmax(method):
    k = 4
    states = [_state(20 + r, temperature=0.0, repetition_penalty=1.5 if r % 2 else 1.0) for r in range(5)]
    logits, drafts, want_a, want_y = _greedy_case(states, [1, 2, 3, 4, 0], k)
    sv = SpecVerifier(Sampler([EOS]))
    p = sv.target_probs(logits, states, drafts, [k] * 5)
    q = torch.nn.functional.one_hot(drafts, V).float()
    a, y = sv.verify(method, p, drafts, q, [k] * 5, states)
    assert a.tolist() == want_a == [0, 1, 2, 3, 4]
    assert y.tolist() == want_y


@pytest.mark.parametrize("method", ["token", "block"])
def test_greedy_rows_in_a_sampled_batch_still_verify_greedily(method):
    k = 3
    greedy = [_state(30 + r, temperature=0.0) for r in range(3)]
    logits, drafts, want_a, want_y = _greedy_case(greedy, [2, 0, 1], k)
    sampled = _mixed_states()[0]
    states = [sampled, greedy[0], greedy[1], _mixed_states()[2], greedy[2]]
    sv = SpecVerifier(Sampler([EOS]))
    d_s, q_s = _drafts(sv, [sampled, states[3]], k)
    all_d = torch.stack([d_s[0], drafts[0], drafts[1], d_s[1], drafts[2]])
    q = torch.nn.functional.one_hot(all_d, V).float()
    q[0], q[3] = q_s[0], q_s[1]
    s_logits = _flat_logits([k, k])
    all_logits = torch.cat([s_logits[: k + 1], logits[: 2 * (k + 1)], s_logits[k + 1:], logits[2 * (k + 1):]])
    p = sv.target_probs(all_logits, states, all_d, [k] * 5)
    a, y = sv.verify(method, p, all_d, q, [k] * 5, states)
    assert [a[i].item() for i in (1, 2, 4)] == want_a
    assert [y[i].item() for i in (1, 2, 4)] == want_y


# --------------------------------------------------------------------------- k = 0 and keys (§3d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["token", "block"])
def test_no_drafts_is_the_plain_sampler_token(method, device):
    states = _mixed_states() * 4
    states = [SamplingState(s.params, s.prompt_token_ids, 100 + i, list(s.output_token_ids))
              for i, s in enumerate(states)]
    counts = [0 if i % 2 == 0 else 1 + i % 3 for i in range(len(states))]  # k_r = 0 requests beside drafting ones
    sampler = Sampler([EOS])
    sv = SpecVerifier(sampler)
    logits = _flat_logits(counts, seed=9, device=device)
    drafts, q = _drafts(sv, states, 3, device=device)
    p = sv.target_probs(logits, states, drafts, counts)
    a, y = sv.verify(method, p, drafts, q, counts, states)
    first_rows = torch.tensor([sum(counts[:r]) + r for r in range(len(states))], device=device)
    plain = sampler(logits[first_rows], states).sampled_token_ids
    zero = [r for r, c in enumerate(counts) if c == 0]
    assert a[zero].eq(0).all()
    assert y[zero].tolist() == plain[zero].tolist()


@pytest.mark.parametrize("method", ["token", "block"])
def test_seeded_verification_is_batch_invariant(method):
    k = 4
    sv = SpecVerifier(Sampler([EOS]))
    me = _mixed_states()[0]
    g = torch.Generator().manual_seed(4)
    draft_logits = torch.randn(k, V, generator=g)
    target_logits = torch.randn(k + 1, V, generator=g)

    def run(batch, at, counts):
        rng = torch.Generator().manual_seed(len(batch))
        ds, qs = [], []
        for j in range(k):
            x = torch.randn(len(batch), V, generator=rng)
            x[at] = draft_logits[j]
            d, q = sv.draft(x, batch, [s.position for s in batch], j)
            ds.append(d)
            qs.append(q)
        rows = [target_logits[: c + 1] if r == at else torch.randn(c + 1, V, generator=rng)
                for r, c in enumerate(counts)]
        d, q = torch.stack(ds, 1), torch.stack(qs, 1)
        p = sv.target_probs(torch.cat(rows), batch, d, counts)
        a, y = sv.verify(method, p, d, q, counts, batch)
        return d[at].tolist(), int(a[at]), int(y[at])

    alone = run([me], 0, [k])
    others = [_state(900 + i, temperature=0.7 + 0.1 * i, top_p=0.8) for i in range(5)]
    beside = run([others[0], others[1], me, *others[2:]], 2, [1, 3, k, 0, 2, 4])
    assert alone == beside
    assert alone != run([_state(999, **{f: getattr(me.params, f) for f in ("temperature", "top_k", "top_p")})], 0, [k])


# --------------------------------------------------------------------------- drafted EOS (§6.5)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_drafted_eos_counts_only_when_the_target_takes_it(method):
    sv = SpecVerifier(Sampler([EOS]))
    logits = torch.zeros(3, V)
    logits[:, 7] = 1.0
    logits[1, EOS] = 5.0  # the target's argmax at row 1 (draft 2) is EOS, unless min_tokens masks it
    drafts = torch.tensor([[7, EOS], [7, EOS]])
    q = torch.nn.functional.one_hot(drafts, V).float()
    free, held = _state(1, temperature=0.0), _state(2, temperature=0.0, min_tokens=4)  # 2 outputs + d_1 < 4
    p = sv.target_probs(torch.cat([logits, logits]), [free, held], drafts, [2, 2])
    a, y = sv.verify(method, p, drafts, q, [2, 2], [free, held])
    assert a.tolist() == [2, 1]
    assert y.tolist() == [7, 7]


def _draft_block(sv: SpecVerifier, drafter: torch.Tensor, states, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k drafts per request from the same drafter logits [n, V] at every slot: (drafts [n, k], Q [n, k, V])."""
    ds, qs = zip(*(sv.draft(drafter, states, [s.position for s in states], j) for j in range(k)))
    return torch.stack(ds, 1), torch.stack(qs, 1)


@pytest.mark.parametrize("method", ["token", "block"])
def test_sampled_eos_draft_is_rejected_while_min_tokens_masks_it(method):
    n, k = 4000, 3
    states = [_state(5000 + i, temperature=1.0, min_tokens=4) for i in range(n)]  # rows 0-1 mask EOS, row 2 not
    sv = SpecVerifier(Sampler([EOS]))
    drafter = torch.zeros(n, V)
    drafter[:, EOS] = 3.0  # Q(EOS) ≈ 0.57 at every slot
    d, q = _draft_block(sv, drafter, states, k)
    target = torch.zeros(k + 1, V)
    target[:, EOS] = 2.0
    p = sv.target_probs(target.repeat(n, 1), states, d, [k] * n)
    a, y = sv.verify(method, p, d, q, [k] * n, states)
    emitted = torch.cat([d, torch.zeros(n, 1, dtype=torch.int64)], 1)
    emitted[torch.arange(n), a] = y
    position = torch.arange(k + 1)
    eos_at = (emitted == EOS) & (position <= a[:, None])
    assert not eos_at[:, :2].any()  # never EOS while len(output) + j < min_tokens
    assert eos_at[:, 2].any()  # and accepted (or sampled) once allowed
    # The first emitted token follows P_1 (EOS masked): its frequencies match the plain law.
    want = p[0, 0].double()
    counts = torch.bincount(emitted[:, 0], minlength=V).double()
    live = want > 0
    assert counts[~live].sum() == 0
    stat = float(((counts[live] - n * want[live]) ** 2 / (n * want[live])).sum())
    assert stat < 60.0  # df 14: p ≈ 1e-7


@pytest.mark.parametrize("method", ["token", "block"])
def test_sampled_end_rate_matches_the_target_eos_probability(method):
    n, k = 8_000, 3
    states = [_state(7000 + i, temperature=1.0) for i in range(n)]
    sv = SpecVerifier(Sampler([EOS]))
    drafter = torch.zeros(n, V)
    drafter[:, EOS] = 2.5
    d, q = _draft_block(sv, drafter, states, k)
    target = torch.zeros(k + 1, V)
    target[:, EOS] = 1.0
    p = sv.target_probs(target.repeat(n, 1), states, d, [k] * n)
    a, y = sv.verify(method, p, d, q, [k] * n, states)
    first = torch.where(a > 0, d[:, 0], y)  # the stop checker ends the request at the first emitted EOS
    ended = float((first == EOS).double().mean())
    p_eos = float(p[0, 0, EOS])
    z = (ended - p_eos) / math.sqrt(p_eos * (1 - p_eos) / n)
    assert abs(z) < 5, (ended, p_eos, z)
