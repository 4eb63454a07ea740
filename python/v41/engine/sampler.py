"""Batched token sampler: one row of logits per request that samples this step.

Processing order, per row (a step is skipped for rows where it is off):

1. ``logit_bias``: ``l[t] += bias[t]``.
2. ``min_tokens``: while ``len(output) < min_tokens``, every ``stop_token_ids`` id and every EOS id
   (EOS ids not when ``ignore_eos``: then EOS does not stop generation and stays sampleable) is set to
   ``-inf`` (KF-12).
3. Repetition penalty over the prompt and output tokens (vLLM / HF rule): a seen token's logit is divided
   by ``repetition_penalty`` when positive and multiplied by it otherwise.
4. Frequency and presence penalties over output tokens only: ``l[t] -= f * count[t] + p * (count[t] > 0)``.
5. Greedy rows (``temperature < 1e-5``) take the argmax here (lowest id on ties) and stop.
6. Temperature: ``l / temperature``.
7. Top-k: keep logits ``>=`` the k-th largest (ties at the boundary are kept).
8. Top-p: sort the renormalized distribution descending (stable), keep the shortest prefix whose mass
   reaches ``top_p``; the most likely token is always kept.
9. Min-p: drop tokens with ``p < min_p * max(p)``.
10. Sample by exponential race: ``argmax(p / q)``, ``q = -log(u)``; this picks token ``t`` with probability
    ``p[t]``.

Randomness (KF-14; docs/speculative-decoding.md §3d): ``u`` [V] is a keyed draw, Philox(key = the request's 64-bit
seed, counter = (vocab column, position of the row's last computed token, purpose "sample"))
(:func:`v41.kernels.sampling.uniforms`), on the logits' device. Every request has a seed: the client's, else one
the engine draws at admission. So a request's tokens depend only on its seed and its positions: not on the batch,
its slot, preemption, the TP rank, or any process-global generator. Greedy rows draw nothing. Every other
operation is row-wise.

Logprobs follow vLLM's default ``raw_logprobs`` mode: ``log_softmax`` of the logits as given to the
sampler (the model's distribution), before bias, masking, penalties, temperature, top-k/top-p/min-p.
Ranks are vLLM's: the number of tokens whose logprob is ``>=`` the token's (1 = most likely).

Cost: one ``[R, V]`` sort for rows with top-k or top-p; penalty rows rebuild ``[R, V]`` masks from the
token lists each step (O(prompt + output) host work per penalized row). Without penalties, bias, min_tokens or
logprobs a step makes no host synchronisation: the random rows' parameters travel in pinned buffers with
non-blocking copies (:mod:`.sampling_inputs`), and the logits are not copied.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from v41.engine.params import Logprob, PromptLogprobs, SamplingParams
from v41.kernels.sampling import PURPOSE_SAMPLE, keyed_race
from v41.kernels.softmax import softmax_rows

from .sampling_inputs import SamplingInputs, SamplingRows

Decode = Callable[[int], str]
_U64 = (1 << 64) - 1


def seed_bits(seed: int) -> int:
    """A seed in [-2**63, 2**64 − 1] as the signed int64 holding its low 64 bits (the Philox key)."""
    b = seed & _U64
    return b - (1 << 64) if b >= 1 << 63 else b


@dataclass(slots=True)
class SamplingState:
    """Per-request sampling inputs, carried across steps by the engine's request record.

    ``prompt_token_ids`` / ``output_token_ids``: ids seen so far (penalties, min_tokens); the engine
    appends each committed token to ``output_token_ids``. ``seed``: the request's 64-bit sampling key
    (``params.seed``, else drawn by the engine at admission). ``pending``: tokens already sampled whose ids
    have not reached the host (async scheduling, :mod:`.pending`): they count in :attr:`position` and in
    ``min_tokens``.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    pending: int = 0
    _prompt_ids_cpu: Tensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None = None) -> SamplingState:
        """State for a new request: its key is ``params.seed``, else ``seed`` (the engine's draw), else a
        fresh random 64-bit value."""
        key = params.seed if params.seed is not None else seed
        if key is None:
            key = int.from_bytes(os.urandom(8), "little")
        return cls(params=params, prompt_token_ids=prompt_token_ids, seed=seed_bits(key))

    @property
    def position(self) -> int:
        """Position of the last known token: the row that samples the next one computes it."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending - 1

    def extended(self, token_ids: Sequence[int]) -> SamplingState:
        """This request with ``token_ids`` appended to its output: a hypothesised continuation, e.g. the drafts
        a verify row assumes (docs/speculative-decoding.md §3e). Shares the prompt's cached id tensor."""
        view = SamplingState(self.params, self.prompt_token_ids, self.seed, [*self.output_token_ids, *token_ids],
                             self.pending)
        view._prompt_ids_cpu = self._prompt_ids_cpu
        return view

    def seen_token_ids(self) -> Tensor:
        """Prompt + output ids, [P + O] int64 on the CPU (the prompt part is converted once)."""
        if self._prompt_ids_cpu is None:
            self._prompt_ids_cpu = torch.as_tensor(list(self.prompt_token_ids), dtype=torch.int64)
        out = torch.as_tensor(self.output_token_ids, dtype=torch.int64)
        return torch.cat([self._prompt_ids_cpu, out])


@dataclass(frozen=True, slots=True)
class LogprobsTensors:
    """Logprobs of chosen tokens plus top-n alternatives, M rows.

    ``token_ids`` [M] int64; ``token_logprobs`` [M] float32; ``ranks`` [M] int64 (1 = most likely);
    ``top_token_ids`` [M, n] int64 and ``top_logprobs`` [M, n] float32, most likely first.
    """

    token_ids: Tensor
    token_logprobs: Tensor
    ranks: Tensor
    top_token_ids: Tensor
    top_logprobs: Tensor

    def to_dicts(self, num_logprobs: Sequence[int], decode: Decode | None = None) -> list[dict[int, Logprob]]:
        """Row ``i`` as ``{id: Logprob}``: the chosen token first, then its ``num_logprobs[i]`` alternatives.

        As in vLLM, an alternative that is the chosen token overwrites it in place (same position).
        ``decode`` fills ``Logprob.decoded_token`` when given.
        """
        ids = self.token_ids.tolist()
        lps = self.token_logprobs.tolist()
        ranks = self.ranks.tolist()
        top_ids = self.top_token_ids.tolist()
        top_lps = self.top_logprobs.tolist()
        rows: list[dict[int, Logprob]] = []
        for i, n in enumerate(num_logprobs):
            d = {ids[i]: Logprob(lps[i], ranks[i], decode(ids[i]) if decode else None)}
            for j in range(n):
                t = top_ids[i][j]
                d[t] = Logprob(top_lps[i][j], j + 1, decode(t) if decode else None)
            rows.append(d)
        return rows


def gather_logprobs(logprobs: Tensor, token_ids: Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprob and rank of ``token_ids`` plus the ``num_logprobs`` best alternatives.

    ``logprobs`` [M, V] float32 (a log_softmax); ``token_ids`` [M] int64; ``num_logprobs`` >= 0.
    """
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64)
    token_lp = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs >= token_lp).sum(dim=-1)
    k = min(num_logprobs, logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], token_ids[:, None][:, :0])
    return LogprobsTensors(token_ids, token_lp[:, 0], ranks, top_ids, top_lp)


def compute_prompt_logprobs(
    logits: Tensor, prompt_ids: Sequence[int], num_logprobs: int, decode: Decode | None = None
) -> PromptLogprobs:
    """Prompt logprobs (vLLM ``prompt_logprobs``) from the raw logits of a whole prompt.

    ``logits``: [T, V] or [T - 1, V] (float), row ``t`` = the model's output at prompt position ``t``,
    i.e. the distribution of token ``t + 1``; a row ``T - 1`` (predicting the first generated token) is
    ignored. ``prompt_ids``: the T prompt ids. Returns T entries: None at position 0, then
    ``{id: Logprob}`` with the actual prompt token (rank included) and its ``num_logprobs`` alternatives.

    Errors: ``ValueError`` when the shapes do not match.
    """
    t_len = len(prompt_ids)
    if logits.dim() != 2 or logits.shape[0] not in (t_len, max(t_len - 1, 0)):
        raise ValueError(f"logits {tuple(logits.shape)} do not match a prompt of {t_len} tokens")
    if t_len <= 1:
        return [None] * t_len
    lp = torch.log_softmax(logits[: t_len - 1].float(), dim=-1)
    targets = torch.as_tensor(list(prompt_ids[1:]), dtype=torch.int64)
    dicts = gather_logprobs(lp, targets, num_logprobs).to_dicts([num_logprobs] * (t_len - 1), decode)
    return [None, *dicts]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """``sampled_token_ids`` [N] int64; ``logprobs``: all N rows, or None when no row asked for logprobs;
    ``ready``: an event after which host copies (:meth:`to_host`) hold their values, None when they do now."""

    sampled_token_ids: Tensor
    logprobs: LogprobsTensors | None = None
    ready: torch.cuda.Event | None = None

    def to_host(self) -> SamplerOutput:
        """This output copied into pinned host memory without waiting for the GPU (non-blocking copies queued
        on the current stream, then an event): the host reads it after :meth:`wait`, which waits for this
        step only, not for work queued after it. On a CPU device: itself."""
        if self.sampled_token_ids.device.type != "cuda":
            return self
        def host(t: Tensor) -> Tensor:
            return t.to("cpu", non_blocking=True)  # pinned destination (PyTorch pins non-blocking D2H copies)
        lp = self.logprobs
        if lp is not None:
            lp = LogprobsTensors(host(lp.token_ids), host(lp.token_logprobs), host(lp.ranks), host(lp.top_token_ids),
                                 host(lp.top_logprobs))
        ready = torch.cuda.Event()
        ids = host(self.sampled_token_ids)
        ready.record(torch.cuda.current_stream(self.sampled_token_ids.device))
        return SamplerOutput(ids, lp, ready)

    def wait(self) -> None:
        """Block until the host copies of :meth:`to_host` are complete (no-op otherwise)."""
        if self.ready is not None:
            self.ready.synchronize()

    def row_logprobs(
        self, states: Sequence[SamplingState], decode: Decode | None = None
    ) -> list[dict[int, Logprob] | None]:
        """Per row: ``{id: Logprob}`` with ``params.logprobs`` alternatives, None for rows that did not ask."""
        if self.logprobs is None:
            return [None] * len(states)
        ns = [s.params.logprobs or 0 for s in states]
        dicts = self.logprobs.to_dicts(ns, decode)
        return [d if s.params.logprobs is not None else None for d, s in zip(dicts, states)]


class Sampler:
    """Samples one token per row; see the module docstring for the order of operations.

    ``eos_token_ids``: every id that ends generation as EOS (model and generation config), masked by
    ``min_tokens`` unless ``ignore_eos``.
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._sampling_inputs: SamplingInputs | None = None

    def __call__(self, logits: Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Sample one token per row.

        ``logits``: [N, V] float (converted to float32), row ``i`` for ``states[i]``; it is not modified.
        Returns sampled ids [N] int64 on ``logits.device`` and, when any row has ``params.logprobs`` set,
        raw logprobs for all rows (chosen token, rank and ``max(logprobs)`` alternatives).

        Errors: ``ValueError`` for a shape mismatch or a ``logit_bias`` id outside ``[0, V)``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} sampling rows")
        n_rows, vocab = logits.shape
        device = logits.device
        raw = logits.float()
        x = self.penalized_logits(raw, states)

        rand = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if len(rand) < n_rows or n_rows == 0:
            sampled = x.argmax(dim=-1)
        if rand:
            r_states = [states[i] for i in rand]
            rows = self._inputs(device).load([s.params for s in r_states], rand, [s.seed for s in r_states],
                                             [s.position for s in r_states], vocab)
            sub = x if len(rand) == n_rows else x.index_select(0, rows.index)
            picked = keyed_race(probs_from_rows(sub, rows), rows.seed, rows.position, PURPOSE_SAMPLE)
            sampled = picked if len(rand) == n_rows else sampled.index_copy_(0, rows.index, picked)

        asked = [s.params.logprobs for s in states if s.params.logprobs is not None]
        lp = None
        if asked:
            lp = gather_logprobs(torch.log_softmax(raw, dim=-1), sampled, max(asked))
        return SamplerOutput(sampled, lp)

    def penalized_logits(self, logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
        """Steps 1-4 (bias, min_tokens, repetition, frequency/presence): [N, V] -> [N, V] float32, a new tensor
        where any row has one of them, else ``logits`` as float32 (nothing to copy).

        Greedy rows take the argmax of this. Errors: ``ValueError`` for a ``logit_bias`` id outside [0, V).
        """
        if not any(has_processor(s) for s in states):
            return logits.float()
        x = logits.float().clone()
        self._apply_logit_bias(x, states)
        self._apply_min_tokens(x, states)
        _apply_repetition_penalty(x, states)
        _apply_frequency_presence_penalties(x, states)
        return x

    # ----------------------------------------------------------------- steps 1-2

    def _apply_logit_bias(self, x: Tensor, states: Sequence[SamplingState]) -> None:
        rows: list[int] = []
        toks: list[int] = []
        vals: list[float] = []
        vocab = x.shape[1]
        for i, s in enumerate(states):
            for t, b in (s.params.logit_bias or {}).items():
                if not 0 <= t < vocab:
                    raise ValueError(f"logit_bias token id {t} is outside the vocabulary [0, {vocab})")
                rows.append(i)
                toks.append(t)
                vals.append(float(b))
        if rows:
            idx = (_on_device(rows, x.device), _on_device(toks, x.device))
            x.index_put_(idx, _on_device(vals, x.device, x.dtype), accumulate=True)

    def _apply_min_tokens(self, x: Tensor, states: Sequence[SamplingState]) -> None:
        rows: list[int] = []
        toks: list[int] = []
        vocab = x.shape[1]
        for i, s in enumerate(states):
            p = s.params
            if len(s.output_token_ids) + s.pending >= p.min_tokens:
                continue
            ids = set(p.stop_token_id_list)
            if not p.ignore_eos:
                ids.update(self.eos_token_ids)
            for t in sorted(ids):
                if 0 <= t < vocab:
                    rows.append(i)
                    toks.append(t)
        if rows:
            # -inf added (the logit-bias pattern): a plain indexed assignment of a number synchronises the stream
            minus_inf = _on_device([float("-inf")] * len(rows), x.device, x.dtype)
            x.index_put_((_on_device(rows, x.device), _on_device(toks, x.device)), minus_inf, accumulate=True)

    def _inputs(self, device: torch.device) -> SamplingInputs:
        """The pinned parameter buffers for ``device`` (made on first use)."""
        if self._sampling_inputs is None or self._sampling_inputs.device != torch.device(device):
            self._sampling_inputs = SamplingInputs(device)
        return self._sampling_inputs


def _on_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """``values`` as a tensor on ``device`` without a host synchronisation (a pinned copy, non-blocking: a copy
    from pageable memory would wait for the stream, i.e. for the step the engine just launched)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


# --------------------------------------------------------------------- steps 3-4


def has_processor(s: SamplingState) -> bool:
    """Whether any of steps 1-4 changes this row's logits."""
    p = s.params
    return bool(p.logit_bias or len(s.output_token_ids) + s.pending < p.min_tokens or p.repetition_penalty != 1.0
                or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)


def _apply_repetition_penalty(x: Tensor, states: Sequence[SamplingState]) -> None:
    rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if not rows:
        return
    device = x.device
    seen_ids = [states[i].seen_token_ids() for i in rows]
    r = torch.cat([torch.full((len(t),), j, dtype=torch.int64) for j, t in enumerate(seen_ids)])
    seen = torch.zeros(len(rows), x.shape[1], dtype=torch.bool, device=device)
    seen[r.to(device), torch.cat(seen_ids).to(device)] = True
    idx = torch.tensor(rows, device=device)
    sub = x[idx]
    rp = torch.tensor([states[i].params.repetition_penalty for i in rows], device=device)[:, None]
    penalized = torch.where(sub > 0, sub / rp, sub * rp)
    x[idx] = torch.where(seen, penalized, sub)


def _apply_frequency_presence_penalties(x: Tensor, states: Sequence[SamplingState]) -> None:
    rows = [
        i
        for i, s in enumerate(states)
        if (s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0) and s.output_token_ids
    ]
    if not rows:
        return
    device = x.device
    outs = [states[i].output_token_ids for i in rows]
    r = torch.tensor([j for j, o in enumerate(outs) for _ in o], device=device)
    t = torch.tensor([tok for o in outs for tok in o], device=device)
    counts = torch.zeros(len(rows), x.shape[1], dtype=x.dtype, device=device)
    counts.index_put_((r, t), torch.ones_like(t, dtype=x.dtype), accumulate=True)
    f = torch.tensor([states[i].params.frequency_penalty for i in rows], dtype=x.dtype, device=device)
    p = torch.tensor([states[i].params.presence_penalty for i in rows], dtype=x.dtype, device=device)
    idx = torch.tensor(rows, device=device)
    x[idx] = x[idx] - f[:, None] * counts - p[:, None] * (counts > 0).to(x.dtype)


# --------------------------------------------------------------------- steps 6-9


def sampling_probs(x: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Steps 6-9: [R, V] penalized logits of non-greedy rows -> [R, V] float32 probabilities sampled from.

    Row ``i`` uses ``params[i]`` (temperature > 0); each row sums to 1. (:func:`probs_from_rows` with the
    parameters copied plainly.)
    """
    return probs_from_rows(x, SamplingRows.of(params, x.shape[1], x.device))


def probs_from_rows(x: Tensor, rows: SamplingRows) -> Tensor:
    """:func:`sampling_probs` with the parameters already on ``x``'s device (no host synchronisation). Without
    top-k / top-p the temperature and the softmax are one kernel pair (:func:`v41.kernels.softmax.softmax_rows`)."""
    if rows.use_top_k or rows.use_top_p:
        probs = softmax_rows(_top_k_top_p(x / rows.temperature.to(x.dtype)[:, None], rows))
    else:
        probs = softmax_rows(x, rows.temperature)
    if rows.use_min_p:
        threshold = rows.min_p.to(x.dtype)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(x: Tensor, rows: SamplingRows) -> Tensor:
    """Mask (-inf) what top-k, then top-p (over the top-k renormalized distribution) remove."""
    neg_inf = float("-inf")
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    if rows.use_top_k:
        kth = sorted_x.gather(1, rows.top_k[:, None] - 1)
        sorted_x = sorted_x.masked_fill(sorted_x < kth, neg_inf)
    if rows.use_top_p:
        # Rows without top-p hold TOP_P_OFF, a threshold no cumulative sum reaches (rounding can reach 1.0).
        probs_sorted = torch.softmax(sorted_x, dim=-1)
        cum = probs_sorted.cumsum(dim=-1)
        mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        remove = mass_before >= rows.top_p.to(x.dtype)[:, None]
        remove[:, 0] = False
        sorted_x = sorted_x.masked_fill(remove, neg_inf)
    return torch.empty_like(x).scatter_(1, order, sorted_x)
