"""Speculative sampling and verification for DSpark drafts (docs/speculative-decoding.md §3).

A batch of B requests, request ``r`` verifying ``k_r ∈ [0, K]`` drafts (tensors padded to K):

* **Drafting** (§3d): :meth:`SpecVerifier.draft` draws ``d_{j+1}`` for draft slot ``j`` from ``Q_{j+1}`` =
  steps 6-9 of the plain sampler (``engine/sampler.py``: temperature, top-k, top-p, min-p) on the drafter's
  logits, by the exponential race. Steps 1-4 (logit bias, min_tokens, penalties) are **not** applied to drafts:
  exactness needs only that ``Q`` is what the draft was drawn from (§3e), and skipping them needs no host copy
  of the drafts. Greedy requests take the argmax (lowest id on ties) and ``Q`` one-hot.
* **Target rows** (§3e): :meth:`SpecVerifier.target_probs` gives ``P_1..P_{k_r+1}``, row ``j`` processed by the
  plain sampler's own steps 1-9 for the output extended by ``d_1..d_j`` (``SamplingState.extended``); greedy
  requests get the one-hot argmax of the penalized logits.
* **Verification** (§3a-c): :func:`accept` gives the accepted count ``a`` and the law of the extra token ``y``;
  :meth:`SpecVerifier.verify` draws the keys and ``y``. Greedy requests verify greedily under every method.

Keys (§3d). Every draw is ``uniforms(seed, n, ·, purpose, slot)`` (``kernels/sampling.py``) with ``n`` the
request's anchor position (= ``SamplingState.position`` once ``x0`` is in the output) and ``slot`` the verify row
the draw concerns: row ``j`` computes position ``n + j`` and yields ``P_{j+1}``.

=====================================================  ==============  ======  =========
draw                                                   purpose         slot    columns
=====================================================  ==============  ======  =========
draft ``d_{j+1}`` (race over ``Q_{j+1}``)              PURPOSE_DRAFT   j       V
accept test of ``d_{j+1}`` (``u_{j+1}`` / ``η_{j+1}``)   PURPOSE_ACCEPT  j       1 (col 0)
extra token ``y`` after ``a`` accepted (race)          PURPOSE_SAMPLE  a       V
=====================================================  ==============  ======  =========

Within a step no two draws share (purpose, slot); ``n`` grows by ``a + 1 ≥ 1`` every step, so no later step
repeats a counter. The plain sampler draws (its row's position, PURPOSE_SAMPLE, slot 0): with ``k_r = 0``, ``y``
is that very draw over ``P_1``, the plain sampler's token bit for bit.

Cost: ``[B, K+1, V]`` float32 target rows and ``[B, K, V]`` draft rows; no host synchronisation in
:meth:`~SpecVerifier.draft` and :meth:`~SpecVerifier.verify` (host values travel pinned and non-blocking);
:meth:`~SpecVerifier.target_probs` copies the drafts to the host only when a request has a step 1-4 processor
(as the plain sampler synchronises for them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from v41.kernels.sampling import PURPOSE_ACCEPT, PURPOSE_DRAFT, PURPOSE_SAMPLE, keyed_race, uniforms

from .sampler import Sampler, SamplingState, has_processor, probs_from_rows
from .sampling_inputs import SamplingInputs

METHODS = ("greedy", "token", "block")


def accept_uniforms(seeds: Tensor, positions: Tensor, num_rows: int) -> Tensor:
    """[B, num_rows] float32 accept draws: column 0 of ``uniforms(seed, n, 1, PURPOSE_ACCEPT, slot j)`` at
    ``[r, j]``. ``seeds`` / ``positions`` [B] int64 (anchor positions ``n``)."""
    b = seeds.shape[0]
    slots = torch.arange(num_rows, device=seeds.device).repeat(b)
    u = uniforms(seeds.repeat_interleave(num_rows), positions.repeat_interleave(num_rows), 1, PURPOSE_ACCEPT, slots)
    return u.view(b, num_rows)


def accept(method: str, target: Tensor, drafts: Tensor, draft_probs: Tensor, num_drafts: Tensor, greedy: Tensor,
           eta: Tensor | None) -> tuple[Tensor, Tensor]:
    """Accepted drafts and the law of the extra token (docs/speculative-decoding.md §3a-c).

    ``target`` [B, K+1, V] float32 ``P_1..P_{K+1}``; ``drafts`` [B, K] int64; ``draft_probs`` [B, K, V] float32
    ``Q_1..Q_K`` with ``Q_i(d_i) > 0``; ``num_drafts`` [B] int64 ``k_r`` (rows and drafts past it are ignored);
    ``greedy`` [B] bool: these requests verify greedily whatever ``method``; ``eta`` [B, K] float32 accept
    uniforms (:func:`accept_uniforms`; unused by ``"greedy"``).

    Returns ``accepted`` [B] int64 in ``[0, k_r]`` and ``weights`` [B, V] float32 (>= 0, positive sum): ``y``'s
    law up to a factor. Greedy: ``a`` = first ``i`` with ``d_i ≠ argmax P_i``, weights one-hot at
    ``argmax P_{a+1}``. Token-wise: accept while ``η_i Q_i(d_i) <= P_i(d_i)``, weights ``(P_{a+1} − Q_{a+1})_+``.
    Block: ``a = τ``, the last row with ``η_i <= h_i``, weights ``(b_τ P_{τ+1} − Q_{τ+1})_+``. ``Q_{k_r+1}`` is
    taken as 0, so ``a = k_r`` gives the bonus law ``P_{k_r+1}`` and ``h_{k_r} = b_{k_r}`` with no special case.
    A residual that rounds to all zeros falls back to ``P_{a+1}``.

    Errors: ``ValueError`` for an unknown ``method``.
    """
    if method not in METHODS:
        raise ValueError(f"verification method must be one of {METHODS}, got {method!r}")
    b, rows, vocab = target.shape
    k = rows - 1
    device = target.device
    live = torch.arange(k, device=device) < num_drafts[:, None]
    d = torch.where(live, drafts, 0)[..., None]
    best = target.argmax(dim=-1)
    a_greedy = _leading(live & (d[..., 0] == best[:, :k]))
    at = torch.arange(b, device=device)
    if method == "greedy":
        return a_greedy, _one_hot(best[at, a_greedy], vocab)
    q = torch.cat([torch.where(live[..., None], draft_probs, 0.0), target.new_zeros(b, 1, vocab)], dim=1)
    p_d = target[:, :k].gather(2, d)[..., 0]
    q_d = q[:, :k].gather(2, d)[..., 0]
    if method == "token":
        a = _leading(live & (eta * q_d <= p_d))
        scale = torch.ones(b, 1, device=device)
    else:
        a, scale = _block(target, q, p_d, q_d, live, eta)
    p_a = target[at, a]
    w = (scale * p_a - q[at, a]).clamp_(min=0.0)
    w = torch.where(w.sum(dim=-1, keepdim=True) > 0, w, p_a)
    a = torch.where(greedy, a_greedy, a)
    w = torch.where(greedy[:, None], _one_hot(best[at, a_greedy], vocab), w)
    return a, w


def _block(target: Tensor, q: Tensor, p_d: Tensor, q_d: Tensor, live: Tensor, eta: Tensor) -> tuple[Tensor, Tensor]:
    """Block verification (Sun et al. 2024; docs/speculative-decoding.md §3c): ``τ`` [B] int64 and ``b_τ`` [B, 1].

    ``log b_i = S_i − max_{0<=j<=i} S_j`` with ``S_i = Σ_{l<=i} log ρ_l``, ``S_0 = 0``; ``r_i = Σ (b_i P_{i+1} −
    Q_{i+1})_+``; ``h_i = r_i / (r_i + 1 − b_i)`` (1 when the denominator is 0)."""
    b, k = p_d.shape
    log_b = torch.where(live, p_d.log() - q_d.log(), 0.0).cumsum(dim=-1)
    log_b = log_b - log_b.cummax(dim=-1).values.clamp(min=0.0)
    b_i = log_b.exp()
    r = (b_i[..., None] * target[:, 1:] - q[:, 1:]).clamp_(min=0.0).sum(dim=-1)
    den = r - torch.expm1(log_b)
    h = torch.where(den > 0, r / den, 1.0)
    rows = torch.arange(1, k + 1, device=p_d.device)
    passed = torch.where(live & (eta <= h), rows, 0)
    tau = torch.cat([passed.new_zeros(b, 1), passed], dim=1).amax(dim=-1)
    b_tau = torch.cat([b_i.new_ones(b, 1), b_i], dim=1).gather(1, tau[:, None])
    return tau, b_tau


def _leading(ok: Tensor) -> Tensor:
    """[B, K] bool -> [B] int64, the number of leading True entries."""
    return ok.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _one_hot(ids: Tensor, vocab: int) -> Tensor:
    return torch.zeros(ids.shape[0], vocab, device=ids.device).scatter_(1, ids[:, None], 1.0)


def to_device(values: list[list[int]], device: torch.device) -> Tensor:
    """[R, n] int64 on ``device``: pinned and non-blocking on CUDA (no host synchronisation)."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class SpecVerifier:
    """Draft sampling, target rows and verification for B speculating requests (module docstring).

    ``sampler``: the plain sampler whose processors and EOS ids the target rows use.
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._sampling_inputs: SamplingInputs | None = None

    def draft(self, logits: Tensor, states: Sequence[SamplingState], anchor_positions: Sequence[int],
              slot: int) -> tuple[Tensor, Tensor]:
        """Draw ``d_{slot+1}`` for each request from the drafter's logits of draft slot ``slot``.

        ``logits`` [B, V] float (not modified); ``anchor_positions``: ``n`` of the verify step the drafts belong to
        (after this step's commit, the new anchor's position). Returns ids [B] int64 and ``Q`` [B, V] float32,
        exactly the law each id was drawn from (one-hot for greedy requests). Keys: (seed, n, PURPOSE_DRAFT, slot).

        Errors: ``ValueError`` for a shape mismatch or a negative ``slot``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states) or len(anchor_positions) != len(states):
            raise ValueError(f"draft logits {tuple(logits.shape)}, {len(states)} states and {len(anchor_positions)}"
                             " anchor_positions must agree")
        if slot < 0:
            raise ValueError(f"draft slot must be >= 0, got {slot}")
        x = logits.float()
        n_rows, vocab = x.shape
        rand = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if len(rand) < n_rows:
            ids = x.argmax(dim=-1)
            probs = _one_hot(ids, vocab)
        if rand:
            rows = self._inputs(x.device).load([states[i].params for i in rand], rand, [states[i].seed for i in rand],
                                               [anchor_positions[i] for i in rand], vocab)
            q = probs_from_rows(x if len(rand) == n_rows else x.index_select(0, rows.index), rows)
            picked = keyed_race(q, rows.seed, rows.position, PURPOSE_DRAFT, torch.full_like(rows.position, slot))
            if len(rand) == n_rows:
                return picked, q
            ids.index_copy_(0, rows.index, picked)
            probs.index_copy_(0, rows.index, q)
        return ids, probs

    def target_probs(self, logits: Tensor, states: Sequence[SamplingState], drafts: Tensor,
                     num_drafts: Sequence[int]) -> Tensor:
        """The processed target rows ``P_1..P_{k_r+1}`` of every request (docs/speculative-decoding.md §3e).

        ``logits`` [T, V] float, ``T = Σ (k_r + 1)``: request ``r``'s verify rows ``[x0, d_1..d_{k_r}]`` in order,
        requests in ``states`` order (not modified); ``drafts`` [B, K] int64; ``num_drafts`` ``k_r`` in [0, K].
        Row ``j`` is what the plain sampler would sample from after ``output + d_1..d_j``: logit bias, min_tokens on
        ``len(output) + j``, penalties over prompt + output + ``d_{<=j}``, then temperature, top-k, top-p, min-p.
        Returns [B, K+1, V] float32, one-hot argmax of the penalized logits for greedy requests, zero rows past
        ``k_r``.

        Errors: ``ValueError`` for shapes that disagree, a ``k_r`` outside [0, K] or a bad ``logit_bias`` id.
        """
        b, k = len(states), drafts.shape[-1]
        counts = _counts(num_drafts, b, k)
        if drafts.dim() != 2 or drafts.shape[0] != b or logits.dim() != 2 or logits.shape[0] != sum(counts) + b:
            raise ValueError(f"target logits {tuple(logits.shape)} and drafts {tuple(drafts.shape)} do not match"
                             f" {b} requests with {sum(counts)} drafts")
        vocab = logits.shape[1]
        if any(has_processor(s) for s in states):
            hyp = drafts.tolist()  # the penalties read the ids: a host copy, as the plain sampler makes for them
            views = [s.extended(hyp[r][:j]) for r, s in enumerate(states) for j in range(counts[r] + 1)]
        else:
            views = [s for r, s in enumerate(states) for _ in range(counts[r] + 1)]
        x = self.sampler.penalized_logits(logits, views)
        rand = [t for t, v in enumerate(views) if not v.params.is_greedy]
        if len(rand) < len(views):
            probs = _one_hot(x.argmax(dim=-1), vocab)
        if rand:
            rows = self._inputs(x.device).load([views[t].params for t in rand], rand, [0] * len(rand),
                                               [0] * len(rand), vocab)
            if len(rand) == len(views):
                probs = probs_from_rows(x, rows)
            else:
                probs.index_copy_(0, rows.index, probs_from_rows(x.index_select(0, rows.index), rows))
        if all(c == k for c in counts):
            return probs.view(b, k + 1, vocab)
        dest = [r * (k + 1) + j for r in range(b) for j in range(counts[r] + 1)]
        out = probs.new_zeros(b * (k + 1), vocab)
        return out.index_copy_(0, to_device([dest], x.device)[0], probs).view(b, k + 1, vocab)

    def verify(self, method: str, target: Tensor, drafts: Tensor, draft_probs: Tensor, num_drafts: Sequence[int],
               states: Sequence[SamplingState]) -> tuple[Tensor, Tensor]:
        """Verify each request's drafts: ``accepted`` [B] int64 ``a ∈ [0, k_r]`` and ``token`` [B] int64 ``y``.

        ``method`` in :data:`METHODS`; ``target`` [B, K+1, V] float32 (:meth:`target_probs`); ``drafts`` [B, K]
        int64 and ``draft_probs`` [B, K, V] float32 (:meth:`draft`); ``num_drafts`` ``k_r``; ``states``: each
        request's state with ``x0`` as its last output token, so ``position`` is the anchor ``n``. Emit
        ``d_1..d_a, y``; keys as in the module docstring.

        Errors: ``ValueError`` for an unknown method, shapes that disagree or a ``k_r`` outside [0, K].
        """
        b = len(states)
        if target.dim() != 3 or target.shape[0] != b:
            raise ValueError(f"target rows {tuple(target.shape)} do not match {b} requests")
        k, vocab = target.shape[1] - 1, target.shape[2]
        if tuple(drafts.shape) != (b, k) or tuple(draft_probs.shape) != (b, k, vocab):
            raise ValueError(f"drafts {tuple(drafts.shape)} / draft_probs {tuple(draft_probs.shape)} do not match"
                             f" target rows {tuple(target.shape)}")
        counts = _counts(num_drafts, b, k)
        keys = to_device([counts, [int(s.params.is_greedy) for s in states], [s.seed for s in states],
                           [s.position for s in states]], target.device)
        seeds, positions = keys[2], keys[3]
        eta = accept_uniforms(seeds, positions, k) if method != "greedy" else None
        a, w = accept(method, target, drafts, draft_probs, keys[0], keys[1].bool(), eta)
        return a, keyed_race(w, seeds, positions, PURPOSE_SAMPLE, a)

    def _inputs(self, device: torch.device) -> SamplingInputs:
        if self._sampling_inputs is None or self._sampling_inputs.device != torch.device(device):
            self._sampling_inputs = SamplingInputs(device)
        return self._sampling_inputs


def _counts(num_drafts: Sequence[int], b: int, k: int) -> list[int]:
    counts = [int(c) for c in num_drafts]
    if len(counts) != b or not all(0 <= c <= k for c in counts):
        raise ValueError(f"num_drafts must hold {b} counts in [0, {k}], got {counts}")
    return counts
