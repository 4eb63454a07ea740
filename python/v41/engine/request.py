"""The engine core's record of one sequence (one completion of a request; n > 1 gives n sequences)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from .detokenizer import IncrementalDetokenizer
from .params import Logprob, SamplingParams
from .sampler import SamplingState
from .spec_stats import SpecDecodeStats


@dataclass
class Sequence:
    """Python-side state of one scheduled sequence; the Rust scheduler owns its blocks and progress.

    request_id/index: the user request and completion index. seq_id: the scheduler's u64 id.
    prompt_token_ids / output_token_ids: committed tokens (the engine's source of Engram history too).
    max_tokens: the resolved output limit; salt: the prefix-cache namespace it was scheduled under;
    priority: its scheduling priority (lower runs first). num_cached_tokens: prompt tokens its first
    admission took from the prefix cache. ``*_time``: ``time.time()`` of its arrival, first scheduling, first
    and last sampled token and end (vLLM ``RequestMetrics``).
    finish_reason / stop_reason: set once, when the sequence ends. spec_decode: its speculative-decoding
    counters while the engine speculates (``SpecDecodeStats.empty(K)`` at admission, ``add_block`` per verify
    step; :mod:`.spec_stats`), None otherwise.
    """

    request_id: str
    index: int
    seq_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    detok: IncrementalDetokenizer
    max_tokens: int
    salt: str | None = None
    priority: int = 0
    scheduled: bool = False  # in a step batch at least once (its first admission is behind it)
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_upto: int = 0  # output ids already fed to the detokenizer (engine/commit.py read_text)
    sent_tokens: int = 0  # what the engine has already reported (output deltas)
    sent_chars: int = 0
    sent_prompt_logprobs: int = 0
    draft: list[int] = field(default_factory=list)  # speculative drafts the next step verifies (engine/spec_decode)
    draft_q: Tensor | None = None  # [k, V] float32 on the device: the law each draft was drawn from (None: one-hot)
    draft_survival: np.ndarray | None = None  # [K] the last block's survivals (adaptive verification's estimate)
    spec_decode: SpecDecodeStats | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def history(self, pos: int, n: int = 3) -> tuple[int, ...]:
        """The ≤ n committed token ids before position ``pos`` (Engram lookback)."""
        lo, n_prompt, prompt = max(0, pos - n), len(self.prompt_token_ids), self.prompt_token_ids
        if pos <= n_prompt:
            return tuple(prompt[lo:pos])
        out = self.output_token_ids
        return tuple(prompt[lo:]) + tuple(out[max(0, lo - n_prompt):pos - n_prompt])
