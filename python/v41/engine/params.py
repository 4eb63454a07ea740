"""Request-level types: sampling parameters in, request outputs out (vLLM field names and defaults).

:class:`SamplingParams` is what a caller asks for; :meth:`SamplingParams.validate` turns bad values into a
``ValueError`` naming the field (the servers map it to HTTP 400 / gRPC ``INVALID_ARGUMENT``; KF-13:
``max_tokens`` 0 or negative is such an error, never an engine crash). The object is not mutated by the
engine: ``stop``/``stop_token_ids`` keep the caller's spelling and are read through :attr:`stop_strings`
and :attr:`stop_token_id_list`.

:class:`RequestOutput` / :class:`CompletionOutput` / :class:`Logprob` mirror ``vllm.outputs`` and
``vllm.logprobs`` so code written against vLLM reads v41's results unchanged.

Semantics (docs/serving-api.md "Sampling"; vLLM ``SamplingParams``):

* ``temperature`` below ``SAMPLING_EPS`` (1e-5) is greedy: argmax, ``top_p``/``top_k``/``min_p`` and
  ``seed`` are ignored and no randomness is consumed.
* ``top_k`` 0 or -1 and ``top_k`` >= vocab size mean "off"; ``top_p`` 1.0 and ``min_p`` 0.0 are off.
* ``max_tokens=None`` generates until ``max_model_len``; ``min_tokens`` masks every EOS id (unless
  ``ignore_eos``) and every ``stop_token_ids`` id until that many tokens exist.
* ``logprobs=n`` returns, per generated token, the sampled token plus the ``n`` most likely tokens
  (``logprobs=0``: the sampled token only); ``prompt_logprobs`` likewise per prompt token.
* ``n > 1``: the engine runs ``n`` children made by :meth:`SamplingParams.child`, child ``i`` seeded with
  ``seed + i`` when a seed is given (vLLM's parallel sampling), so every child is reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from .spec_stats import SpecDecodeStats

SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # most alternatives one token may ask for (vLLM's default max_logprobs, OpenAI's cap)
MAX_ABS_PENALTY = 2.0  # presence/frequency penalties live in [-2, 2] (OpenAI, vLLM)
DEFAULT_MAX_N = 128  # most completions one request may ask for (EngineArgs.max_n, v41-serve --max-n)
_SEED_MIN = -(2**63)  # torch.Generator.manual_seed accepts [-2**63, 2**64 - 1]
_SEED_MAX = 2**64 - 1

FinishReason = Literal["stop", "length", "abort"]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_request_options(priority: object = 0, cache_salt: object = None) -> None:
    """Check the per-request scheduling options that live beside the sampling parameters: ``priority`` an
    int32 (lower runs first), ``cache_salt`` None or a non-empty string encodable as UTF-8 (no lone
    surrogates).
    Raises ``ValueError`` naming the bad one."""
    if not _is_int(priority) or not -2**31 <= priority < 2**31:
        raise ValueError(f"priority must be an integer in [-2^31, 2^31), got {priority!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if cache_salt == "":  # vLLM refuses it too: an empty tenant id must not land in the shared namespace
        raise ValueError("cache_salt must be a non-empty string when given (omit it for the shared namespace)")
    if cache_salt is not None:
        try:
            cache_salt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"cache_salt must be valid UTF-8 text: {e.reason} at character {e.start}") from None


@dataclass
class SamplingParams:
    """How one request samples and when it stops (vLLM ``SamplingParams`` names and defaults).

    Fields: ``n`` completions per prompt; ``temperature`` (0 = greedy); ``top_p`` in (0, 1];
    ``top_k`` (0 or -1 = off); ``min_p`` in [0, 1]; ``presence_penalty`` / ``frequency_penalty`` in
    [-2, 2] over output tokens; ``repetition_penalty`` > 0 over prompt + output tokens (1 = off);
    ``seed`` (per-request generator, reproducible whatever the batch; KF-14); ``stop`` strings;
    ``stop_token_ids``; ``include_stop_str_in_output``; ``ignore_eos`` (EOS does not stop, stays
    sampleable); ``max_tokens`` (None = until max_model_len); ``min_tokens``; ``logprobs`` /
    ``prompt_logprobs`` (top-n alternatives, 0..20, None = none); ``skip_special_tokens``;
    ``spaces_between_special_tokens`` (accepted for compatibility; fast tokenizers ignore it);
    ``logit_bias`` (token id -> additive bias on the raw logit).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None

    # ----------------------------------------------------------------- derived views

    @property
    def is_greedy(self) -> bool:
        """True when ``temperature < SAMPLING_EPS``: argmax, no randomness consumed."""
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (a bare string becomes a one-element list; None becomes [])."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    @property
    def stop_token_id_list(self) -> list[int]:
        """``stop_token_ids`` as a list (None becomes [])."""
        return [] if self.stop_token_ids is None else list(self.stop_token_ids)

    @property
    def top_k_enabled(self) -> bool:
        """True when ``top_k`` restricts sampling (``top_k >= 1``; callers also treat >= vocab as off)."""
        return self.top_k >= 1

    def child(self, index: int) -> SamplingParams:
        """Params of completion ``index`` of an ``n > 1`` request: ``n=1`` and, when seeded, ``seed + index``.

        Errors: ``ValueError`` when ``index`` is not in ``[0, n)``.
        """
        if not 0 <= index < self.n:
            raise ValueError(f"child index {index} out of range for n={self.n}")
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    # ----------------------------------------------------------------- validation

    def validate(self, vocab_size: int | None = None, max_n: int | None = None) -> None:
        """Check every field; raise ``ValueError`` naming the first bad one.

        ``vocab_size``: the model's vocabulary size (ids must be in ``[0, vocab_size)``); None skips the
        range checks of ``stop_token_ids`` and ``logit_bias`` ids. ``max_n``: the most completions the engine
        takes per request (``EngineArgs.max_n``; the engine does work proportional to ``n`` on every step, so
        an unbounded ``n`` starves every other request); None skips that bound.
        """
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if max_n is not None and self.n > max_n:
            raise ValueError(f"n must be at most {max_n} (the engine's max_n; v41-serve --max-n), got {self.n}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer, -1 or 0 (off) or >= 1, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -MAX_ABS_PENALTY <= v <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {v!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or not math.isfinite(rp) or rp <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        self._validate_stops(vocab_size)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        self._validate_logit_bias(vocab_size)

    def _validate_stops(self, vocab_size: int | None) -> None:
        stop = self.stop
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise ValueError(f"stop must be None, a string or a list of strings, got {stop!r}")
        if any(s == "" for s in self.stop_strings):
            raise ValueError("stop cannot contain an empty string")
        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
                raise ValueError(f"stop_token_ids must be None or a list of integers, got {ids!r}")
            for t in ids:
                if t < 0 or (vocab_size is not None and t >= vocab_size):
                    raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary [0, {vocab_size})")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be None or a dict of token id -> bias, got {type(bias).__name__}")
        for t, b in bias.items():
            if not _is_int(t):
                raise ValueError(f"logit_bias keys must be integer token ids, got {t!r}")
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"logit_bias token id {t} is outside the vocabulary [0, {vocab_size})")
            if not _is_real(b) or not math.isfinite(b):
                raise ValueError(f"logit_bias[{t}] must be a finite number, got {b!r}")


@dataclass
class Logprob:
    """One token's log-probability (vLLM ``Logprob``).

    ``logprob``: natural log of the probability under the raw model distribution (float; see
    ``sampler.py``); ``rank``: 1 = most likely token; ``decoded_token``: the token's text when known.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token id: Logprob} holding the sampled token and the top-n alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: as above, None at position 0 (nothing predicts the first token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM ``CompletionOutput``).

    ``index``: which of the ``n`` completions; ``text``: the detokenized output (stop string removed
    unless ``include_stop_str_in_output``); ``token_ids``: generated ids; ``cumulative_logprob``: sum of
    the sampled tokens' logprobs (None unless logprobs were requested); ``logprobs``: per token, or None;
    ``finish_reason``: "stop" (EOS, stop id or stop string), "length" (max_tokens / max_model_len),
    "abort", or None while running; ``stop_reason``: the matched stop string or stop token id, None for
    EOS, length, abort or while running. ``spec_decode``: the completion's speculative-decoding counters so far
    (:class:`~v41.engine.spec_stats.SpecDecodeStats`; cumulative in every delta output, like the finish reason,
    so the last output holds the completion's totals); None when the engine does not speculate.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    spec_decode: SpecDecodeStats | None = None

    def finished(self) -> bool:
        """True once ``finish_reason`` is set."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request, seconds from ``time.time()``; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request as returned to the caller (vLLM ``RequestOutput``).

    ``prompt`` is None when the request was given as token ids; ``prompt_logprobs`` is None unless
    requested; ``num_cached_tokens``: prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None)
