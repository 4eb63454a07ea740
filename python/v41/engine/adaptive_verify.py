"""Adaptive verification (docs/speculative-decoding.md §4): the full DSpark block is drafted, and each request
sends only a prefix of it to the verifier, chosen from the drafter's confidences and a start-up profile of what
verify steps cost.

* **Survivals.** With raw confidence logits ``c_0..c_{K-1}`` of a block (``c_i`` reads the anchor or draft ``i``,
  never draft ``i + 1``), draft ``t`` (1-based) survives with ``s_t = Π_{i<t} σ(c_i)`` (:func:`survivals`): the
  estimated chance that drafts ``1..t`` are all accepted. ``s_t`` is known before draft ``t`` is drawn.
* **Profile** (:func:`measure_costs`, every rank at start-up, the same work in the same order so collectives
  line up; the planner reads rank 0's table): seconds of a verify step of ``size`` requests × ``q`` query tokens
  each (``q = 1..K+1``, padded static inputs with random token ids, replayed from the step's CUDA graphs where
  they exist) and of a draft pass of ``size`` requests.
* **Plan** (:class:`AdaptivePlanner`): for ``B`` requests and each ``q`` (``B·q`` within the step token
  budget), the expected tokens of the step are ``B + Σ`` of the ``B·(q − 1)`` largest survival estimates; the
  step takes the ``q`` with the most tokens per second of draft + verify time, then verifies, per request, its
  drafts among the ``B·(q − 1)`` largest *current* survivals (ties: earlier request, then earlier draft; so each
  request's set is a prefix). With CUDA graphs every request pads to the step's largest ``q`` anyway, so every
  request verifies ``q − 1`` drafts. Before drafting, the same choice with a plain step costing no draft pass
  decides whether to draft at all (:meth:`AdaptivePlanner.should_draft`): where no ``q`` beats plain decoding
  (large batches of a large model) the engine decodes plainly and runs no draft pass.

**Exactness** (§3, §4). Verification emits the target's law as long as the decision to verify draft ``t`` does
not depend on draft ``t`` or what follows it. Selecting among the current survivals at a fixed budget keeps that:
``(r, t)`` is chosen from the entries ranked above it, which are other requests' (drawn independently) and
``r``'s own earlier ones, functions of drafts ``< t``. Choosing ``q`` from the current survivals of sampled
drafts would not (``s_K`` reads drafts up to ``K − 1``, so verifying an early draft would depend on it), which is
why ``q`` is chosen from *estimates* known before this step's draws: for a request with argmax drafts (greedy
requests, ``draft_sample_method`` greedy) its current survivals, since its drafts are a function of its context
and no draw of theirs can be biased; for sampled drafts the survivals of its previous block, or for a request
without one the mean survival curve of the previous plan (all ones before the first).
Two requests with one sampling key draw the same numbers, so one must not decide on the other's block: a batch
holding such a pair verifies every draft, and a request whose key is among those the prior averaged does not use
the prior. ``tests/test_spec_verify_lossless.py`` checks the planner with the χ² test (token-wise and block), and that a
survival off by one (``Π_{i<=t}``, reading draft ``t`` itself) fails it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("v41.engine")


def survivals(conf: torch.Tensor | np.ndarray) -> np.ndarray:
    """Raw confidence logits [B, K] → survivals [B, K] float64: column ``t − 1`` is ``Π_{i<t} σ(c_i)``
    (NaN logits count as 0: never accepted)."""
    c = np.nan_to_num(np.asarray(conf, dtype=np.float64), nan=-np.inf)
    with np.errstate(over="ignore"):  # exp(inf) = inf: σ(−inf) = 0
        return np.cumprod(1.0 / (1.0 + np.exp(-c)), axis=1)


@dataclass(frozen=True)
class VerifyCosts:
    """Profiled step times. ``sizes``: batch sizes (requests), ascending; ``verify_s`` [len(sizes), K+1]: seconds
    of a verify step of ``sizes[i]`` requests × ``q = j + 1`` query tokens each; ``draft_s`` [len(sizes)]:
    seconds of a draft pass; ``uniform``: every request pads to the step's largest ``q`` (CUDA graphs)."""

    sizes: tuple[int, ...]
    verify_s: np.ndarray
    draft_s: np.ndarray
    uniform: bool

    def step_seconds(self, batch: int, drafted: bool = True) -> np.ndarray:
        """Seconds [K+1] of a step of ``batch`` requests × q = 1..K+1 query tokens: verify plus the draft pass
        (for q = 1 only when ``drafted``: a step that verifies nothing need not draft). The smallest profiled size
        that holds the batch (graphs pad to it), or beyond the largest its times scaled by ``batch / size``."""
        i = next((j for j, s in enumerate(self.sizes) if s >= batch), len(self.sizes) - 1)
        seconds = self.draft_s[i] + self.verify_s[i]
        if not drafted:
            seconds[0] = self.verify_s[i, 0]
        return seconds * max(1.0, batch / self.sizes[i])

    def table(self) -> str:
        """The profile as text (start-up log, benchmarks): one line per size, ms per q."""
        head = "requests  draft ms  " + "  ".join(f"q={q:<5d}" for q in range(1, self.verify_s.shape[1] + 1))
        rows = [f"{s:8d}  {1e3 * d:8.3f}  " + "  ".join(f"{1e3 * v:7.3f}" for v in vs)
                for s, d, vs in zip(self.sizes, self.draft_s, self.verify_s)]
        return "\n".join([head, *rows])


class AdaptivePlanner:
    """Per-step choice of how many drafts each request verifies (module docstring). ``costs``: the profile;
    ``k``: drafts per block (``num_speculative_tokens``); ``max_tokens``: the step token budget
    (``max_num_batched_tokens``): a plan never asks for more decode tokens, so the scheduler never cuts one."""

    def __init__(self, costs: VerifyCosts, k: int, max_tokens: int):
        if costs.verify_s.shape[1] != k + 1:
            raise ValueError(f"the verify-cost profile has {costs.verify_s.shape[1]} query-token columns, "
                             f"K + 1 = {k + 1} expected")
        self.costs, self.k, self.max_tokens = costs, k, max_tokens
        self.prior = np.ones(k)  # the previous plan's mean survival curve
        self.prior_keys: set[int] = set()  # the sampling keys of the requests it averages

    def estimates(self, keys: list[int], own: list[np.ndarray | None]) -> np.ndarray:
        """[B, K] survival estimates: each request's ``own`` (known before its current draws), else the prior —
        unless the request's sampling key is among the prior's, whose draws may be its own (then all ones)."""
        ones = np.ones(self.k)
        return np.stack([e if e is not None else ones if key in self.prior_keys else self.prior
                         for key, e in zip(keys, own)])

    def choose_q(self, estimates: np.ndarray, drafted: bool = True) -> int:
        """Query tokens per request (1..K+1, at most ``max_tokens`` in all) with the most expected tokens per
        second, from survival ``estimates`` [B, K]; ``drafted``: the draft pass has run (it costs every q)."""
        b = estimates.shape[0]
        if self.costs.uniform:  # q − 1 drafts of every request
            extra = np.cumsum(estimates.sum(axis=0))
        else:  # the b·(q − 1) largest estimates
            extra = np.cumsum(np.sort(estimates, axis=None)[::-1])[b * np.arange(1, self.k + 1) - 1]
        score = (b + np.r_[0.0, extra]) / self.costs.step_seconds(b, drafted)
        q_max = max(1, min(self.k + 1, self.max_tokens // b))
        return int(np.argmax(score[:q_max])) + 1  # the smallest q on ties

    def should_draft(self, keys: list[int], own: list[np.ndarray | None]) -> bool:
        """Whether this step's draft pass is worth running: False when, by the estimates, verifying nothing (a
        plain step, no draft pass) beats every q (module docstring). ``keys``: the requests' sampling keys."""
        if len(set(keys)) < len(keys):
            return True
        return self.choose_q(self.estimates(keys, own), drafted=False) > 1

    def plan(self, current: np.ndarray, own: list[np.ndarray | None], keys: list[int]) -> list[int]:
        """Drafts to verify per request, ``k_r ∈ [0, K]``. ``current`` [B, K]: this block's survivals; ``own``:
        per request survivals known before its current draws (module docstring), or None; ``keys``: the requests'
        sampling keys. Two requests with one key draw the same numbers, so neither may decide on the other's
        block: such a batch verifies all K drafts. Updates the prior to this plan's mean curve."""
        b = current.shape[0]
        if b == 0:
            return []
        if len(set(keys)) < len(keys):
            return [self.k] * b
        q = self.choose_q(self.estimates(keys, own))
        self.prior, self.prior_keys = current.mean(axis=0), set(keys)
        if self.costs.uniform or q == 1:
            return [q - 1] * b
        order = np.argsort(-current, axis=None, kind="stable")[:b * (q - 1)]  # value desc, then request, draft
        return np.bincount(order // self.k, minlength=b).tolist()


def measure_costs(runner, k: int, reps: int = 3, seed: int = 0) -> VerifyCosts:
    """Profile ``runner`` (a :class:`~.model_runner.ModelRunner` after ``init_cache``): verify steps of every
    verify-graph size × q = 1..K+1 and draft passes, each timed over ``reps`` runs after one warm-up, the verify
    times made non-decreasing in q. Writes nothing to the cache (every slot −1). Seconds of wall time around a
    device synchronisation."""
    rng = np.random.default_rng(seed)
    vocab = runner.cfg.vocab_size
    sets = {g.query_tokens: g for g in runner.verify_graph_sets(k)}
    sizes = sets[k + 1].sizes
    verify = np.zeros((len(sizes), k + 1))
    draft = np.zeros(len(sizes))
    for i, size in enumerate(sizes):
        for q in range(1, k + 2):
            g = sets[q]
            fit = next(s for s in g.sizes if s >= size) if size <= g.sizes[-1] else g.sizes[-1]
            ids = rng.integers(0, vocab, size=fit * q)
            verify[i, q - 1] = _timed(lambda: g.run_dummy(fit, ids), reps, runner.device)
        pad = np.full(size, runner.tables.padding_row, dtype=np.int64)
        anchors = rng.integers(0, vocab, size=size)
        zeros = np.zeros(size, dtype=np.int64)
        draft[i] = _timed(lambda: runner.draft(pad, anchors, zeros), reps, runner.device)
    verify = np.maximum.accumulate(verify, axis=1)  # more query tokens never cost less: timing noise must not say so
    costs = VerifyCosts(tuple(sizes), verify, draft, uniform=any(g.capture for g in sets.values()))
    log.info("adaptive verification: verify-step cost profile (%s)\n%s",
             "CUDA graphs, padded to the largest q" if costs.uniform else "eager", costs.table())
    return costs


def _timed(fn, reps: int, device) -> float:
    cuda = str(device).startswith("cuda")
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps
