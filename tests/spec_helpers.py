"""A toy target and drafter for the exactness tests of speculative verification (docs/speculative-decoding.md
§3f): V = 6, logits that depend on the last two tokens, processors with top-p, a repetition penalty and
min_tokens; chains of speculative steps vectorised over many sequences, and Pearson's χ² against the exact law.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from v41.engine.params import SamplingParams
from v41.engine.sampler import Sampler, SamplingState, sampling_probs, seed_bits
from v41.engine.spec_verify import SpecVerifier

V, EOS = 6, 5
PROMPT, X0 = [0, 1], 2  # x0: the anchor, already emitted when the chains start
PARAMS = SamplingParams(temperature=0.9, top_p=0.85, repetition_penalty=1.5, min_tokens=3, max_tokens=None)
EMITTED = 3  # tokens after x0 whose law is tested: V**3 cells

_g = torch.Generator().manual_seed(20240615)
TARGET = torch.randn(V, V, V, generator=_g) * 1.5  # [prev2, prev1] -> target logits
DRAFTER = 0.5 * TARGET + torch.randn(V, V, V, generator=_g)  # a drafter that is often, not always, right
_CODES = V * V * 2**V * 2

VerifyFn = Callable[[SpecVerifier, Tensor, Tensor, Tensor, list[int], list[SamplingState]], tuple[Tensor, Tensor]]
DraftFn = Callable[[SpecVerifier, Tensor, list[SamplingState], list[int], int], tuple[Tensor, Tensor]]


def production_verify(method: str) -> VerifyFn:
    return lambda sv, p, d, q, nd, states: sv.verify(method, p, d, q, nd, states)


def production_draft(sv: SpecVerifier, logits: Tensor, states, anchors, slot) -> tuple[Tensor, Tensor]:
    return sv.draft(logits, states, anchors, slot)


class PlainLaw:
    """The plain sampler's processed target row (``Sampler.penalized_logits`` + ``sampling_probs``) of a toy
    context, cached by all it depends on: the last two tokens, the set of seen ids (repetition penalty) and whether
    ``len(output) < min_tokens``, so chains of 10^6 sequences need only a few hundred real processor calls."""

    def __init__(self) -> None:
        self.sampler = Sampler([EOS])
        self.table = torch.zeros(_CODES, V)
        self.known = torch.zeros(_CODES, dtype=torch.bool)

    def probs(self, state: SamplingState) -> Tensor:
        """[V] float32: what the plain sampler samples from for ``state``."""
        ids = [*state.prompt_token_ids, *state.output_token_ids]
        x = self.sampler.penalized_logits(TARGET[ids[-2], ids[-1]][None], [state])
        return sampling_probs(x, [state.params])[0]

    def rows(self, codes: Tensor, view_of: Callable[[int], SamplingState]) -> Tensor:
        """[M, V] rows for context ``codes`` [M]; ``view_of(m)``: a state whose context has ``codes[m]``."""
        for c in codes[~self.known[codes]].unique().tolist():
            self.table[c] = self.probs(view_of(int((codes == c).nonzero()[0, 0])))
            self.known[c] = True
        return self.table[codes]

    def exact(self) -> Tensor:
        """[V**3] float64: the law of the three tokens after x0, cell ``(x1, x2, x3)`` at ``36 x1 + 6 x2 + x3``."""
        law = torch.zeros(V, V, V, dtype=torch.float64)
        state = lambda *out: SamplingState(PARAMS, PROMPT, 0, [X0, *out])  # noqa: E731
        p1 = self.probs(state()).double()
        for x1 in range(V):
            p2 = self.probs(state(x1)).double()
            for x2 in range(V):
                law[x1, x2] = p1[x1] * p2[x2] * self.probs(state(x1, x2)).double()
        return law.flatten()


def _code(p2: Tensor, p1: Tensor, seen: Tensor, out_len: Tensor) -> Tensor:
    return ((p2 * V + p1) * 2**V + seen) * 2 + (out_len < PARAMS.min_tokens).long()


def propose(sv: SpecVerifier, law: PlainLaw, states: list[SamplingState], ctx: tuple[Tensor, ...], nd: Tensor,
            k: int, draft: DraftFn = production_draft) -> tuple[Tensor, Tensor, Tensor]:
    """One step's drafts [m, k], their ``Q`` [m, k, V] (toy drafter, ``draft``) and the target rows
    [m, k+1, V] (zero past ``nd``) for ``states`` in context ``ctx`` = (prev2, prev1, seen bits, len(output))."""
    m = len(states)
    anchors = [s.position for s in states]
    c2, c1 = ctx[0], ctx[1]
    ds, qs = [torch.zeros(m, 0, dtype=torch.int64)], [torch.zeros(m, 0, V)]
    for j in range(k):
        ids, q = draft(sv, DRAFTER[c2, c1], states, anchors, j)
        ds.append(ids[:, None])
        qs.append(q[:, None])
        c2, c1 = c1, ids
    d, q = torch.cat(ds, 1), torch.cat(qs, 1)
    r2, r1, rs, rl = ctx
    codes = []
    for j in range(k + 1):
        codes.append(_code(r2, r1, rs, rl))
        if j < k:
            r2, r1, rs, rl = r1, d[:, j], rs | (1 << d[:, j]), rl + 1
    p = law.rows(torch.stack(codes, 1).flatten(),
                 lambda t: states[t // (k + 1)].extended(d[t // (k + 1), : t % (k + 1)].tolist()))
    return d, q, p.view(m, k + 1, V) * (torch.arange(k + 1) <= nd[:, None])[..., None]


def start_states(n: int, seed: int) -> tuple[list[SamplingState], tuple[Tensor, ...]]:
    """``n`` requests (seeds ``seed + i``) with x0 emitted, and their toy context (prev2, prev1, seen, len)."""
    states = [SamplingState(PARAMS, PROMPT, seed_bits(seed + i), [X0]) for i in range(n)]
    ctx = (torch.full((n,), PROMPT[-1]), torch.full((n,), X0), torch.full((n,), sum(1 << t for t in {*PROMPT, X0})),
           torch.ones(n, dtype=torch.int64))
    return states, ctx


# Adaptive verification's toy confidence: c_i = CONF[out_i] (out_0 = the anchor, out_i = draft i), strongly
# token-dependent so that a verification rule that peeks at a draft's own confidence shows in the χ² test.
CONF = torch.tensor([3.0, -3.0, 2.0, -2.0, 1.0, 0.0])
PlanFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (active chain ids [m], anchors [m], drafts [m, k]) -> k_r [m]


def run_chains(n: int, k: int, verify: VerifyFn, law: PlainLaw, draft: DraftFn = production_draft,
               seed: int = 0, plan: PlanFn | None = None) -> tuple[Tensor, Tensor]:
    """Speculative steps for ``n`` sequences (seeds ``seed + i``) until each emitted ``EMITTED`` tokens after x0.

    Each step drafts ``k`` tokens with the toy drafter; request ``r`` verifies ``k_r = k`` (even ``r``) or a
    random ``k_r ∈ [0, k]`` (odd ``r``), so rows are padded; with ``plan`` the drafts verified are what it
    returns from the drafts (adaptive verification). Returns the emitted tokens [n, 3] int64 and the accepted
    drafts per step [steps·n] (sequences still running).
    """
    sv = SpecVerifier(law.sampler)
    rng = torch.Generator().manual_seed(seed + 7)
    states, ctx = start_states(n, seed)
    out = torch.full((n, EMITTED), -1, dtype=torch.int64)
    done = torch.zeros(n, dtype=torch.int64)
    accepted = []
    while (act := (done < EMITTED).nonzero()[:, 0]).numel():
        m, sts = act.numel(), [states[i] for i in act.tolist()]
        nd = torch.where(act % 2 == 0, k, torch.randint(0, k + 1, (m,), generator=rng))
        c = tuple(t[act] for t in ctx)
        d, q, p = propose(sv, law, sts, c, torch.full_like(nd, k) if plan else nd, k, draft)
        if plan is not None:
            nd = plan(act, c[1], d)
        a, y = verify(sv, p, d, q, nd.tolist(), sts)
        assert bool((a <= nd).all())
        accepted.append(a)
        toks = torch.cat([d, torch.zeros(m, 1, dtype=torch.int64)], 1)
        toks[torch.arange(m), a] = y
        base = done[act]
        c2, c1, seen, out_len = c
        for i in range(k + 1):
            ok = i <= a
            write = ok & (base + i < EMITTED)
            out[act[write], (base + i)[write]] = toks[write, i]
            c2, c1 = torch.where(ok, c1, c2), torch.where(ok, toks[:, i], c1)
            seen = torch.where(ok, seen | (1 << toks[:, i]), seen)
        for t, new in zip(ctx, (c2, c1, seen, out_len + a + 1)):
            t[act] = new
        done[act] = base + a + 1
        for s, t, c_ in zip(sts, toks.tolist(), (a + 1).tolist()):
            s.output_token_ids.extend(t[:c_])
    return out, torch.cat(accepted)


def chi_square(samples: Tensor, law: Tensor) -> tuple[float, int, float, float]:
    """Pearson's χ² of ``samples`` [n, 3] (cells ``36 x1 + 6 x2 + x3``) against ``law`` [V**3]; cells expecting
    fewer than 5 draws merged into one. Returns (statistic, degrees of freedom, p-value, total variation)."""
    n = samples.shape[0]
    counts = torch.bincount(samples @ torch.tensor([V * V, V, 1]), minlength=V**3).double()
    expected = law * n
    assert counts[law == 0].sum() == 0, "emitted a sequence of probability 0"
    small = (expected < 5) & (law > 0)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[small].sum()[None]])
    exp = torch.cat([expected[big], expected[small].sum()[None]])
    live = exp > 0
    stat = float(((obs[live] - exp[live]) ** 2 / exp[live]).sum())
    df = int(live.sum()) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2).double()))
    return stat, df, p, 0.5 * float((counts / n - law).abs().sum())


def tv_bound(law: Tensor, n: int) -> float:
    """0.4·√(cells/n): an upper bound of the mean total variation of n exact draws (√(1/2πn)·Σ√p <= it)."""
    return 0.4 * math.sqrt(int((law > 0).sum()) / n)


def keys(states: Sequence[SamplingState]) -> tuple[Tensor, Tensor]:
    """Seeds and anchor positions [B] int64 of ``states``."""
    return (torch.tensor([s.seed for s in states], dtype=torch.int64),
            torch.tensor([s.position for s in states], dtype=torch.int64))
