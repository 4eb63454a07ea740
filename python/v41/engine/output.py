"""Building the caller-facing :class:`RequestOutput` from the engine's sequences."""

from __future__ import annotations

from .params import CompletionOutput, RequestMetrics, RequestOutput
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
                         num_cached_tokens=first.num_cached_tokens, metrics=request_metrics(seqs))


def request_metrics(seqs: list[Sequence]) -> RequestMetrics:
    """The request's timestamps over its sequences (earliest start events, latest end events)."""
    def first(name: str):
        vals = [getattr(s, name) for s in seqs if getattr(s, name) is not None]
        return min(vals) if vals else None

    def last(name: str):
        vals = [getattr(s, name) for s in seqs if getattr(s, name) is not None]
        return max(vals) if vals else None
    done = all(s.finished for s in seqs)
    return RequestMetrics(arrival_time=first("arrival_time"), first_scheduled_time=first("first_scheduled_time"),
                          first_token_time=first("first_token_time"), last_token_time=last("last_token_time"),
                          finished_time=last("finished_time") if done else None)
