"""Building the caller-facing :class:`RequestOutput` from the engine's sequences."""

from __future__ import annotations

from .params import CompletionOutput, RequestOutput
from .request import Sequence


def build_output(seqs: list[Sequence]) -> RequestOutput:
    """Cumulative output of one request from its n sequences (ordered by completion index). The request
    is finished when every sequence is; text is what the detokenizer has released (stop strings applied)."""
    seqs = sorted(seqs, key=lambda s: s.index)
    first = seqs[0]
    outputs = [CompletionOutput(index=s.index, text=s.detok.text, token_ids=list(s.output_token_ids),
                                cumulative_logprob=s.cumulative_logprob,
                                logprobs=None if s.logprobs is None else list(s.logprobs),
                                finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in seqs]
    return RequestOutput(request_id=first.request_id, prompt=first.prompt,
                         prompt_token_ids=list(first.prompt_token_ids),
                         prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
                         outputs=outputs, finished=all(s.finished for s in seqs),
                         num_cached_tokens=first.num_cached_tokens)
