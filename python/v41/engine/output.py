"""Outputs as per-request deltas (docs/architecture.md §3a): each step the engine core reports, for every request that changed,
only what is new since its previous report — new text, token ids and logprobs of each completion, new prompt
logprobs — so a step costs O(new tokens), never a copy of everything generated so far. Speculative-decoding
counters (``CompletionOutput.spec_decode``) are the exception: a snapshot of the cumulative counts, O(K). Every
consumer (the offline ``LLM``, ``AsyncEngine`` streams, the engine-core process) takes this one format; the ones
that need whole results add the deltas up with :class:`OutputAccumulator`.
"""

from __future__ import annotations

from dataclasses import replace

from .params import CompletionOutput, RequestMetrics, RequestOutput
from .request import Sequence


def delta_output(seqs: list[Sequence]) -> RequestOutput:
    """What is new for one request (its n sequences, by completion index) since the last call, and marks it sent.
    ``prompt_token_ids`` is the request's own list (not copied: do not mutate it); ``cumulative_logprob`` and the
    finish / stop reasons and ``spec_decode`` (a copy) are the current values; the request is finished when every
    sequence is."""
    if len(seqs) > 1:
        seqs = sorted(seqs, key=lambda s: s.index)
    first = seqs[0]
    outputs = []
    for s in seqs:
        n_tok = len(s.output_token_ids)
        outputs.append(CompletionOutput(
            index=s.index, text=s.detok.text_since(s.sent_chars), token_ids=s.output_token_ids[s.sent_tokens:],
            cumulative_logprob=s.cumulative_logprob,
            logprobs=None if s.logprobs is None else s.logprobs[s.sent_tokens:],
            finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            spec_decode=None if s.spec_decode is None else s.spec_decode.copy()))
        s.sent_chars, s.sent_tokens = s.detok.emitted_chars, n_tok
    plp = None
    if first.prompt_logprobs is not None:
        plp = first.prompt_logprobs[first.sent_prompt_logprobs:]
        first.sent_prompt_logprobs = len(first.prompt_logprobs)
    return RequestOutput(request_id=first.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                         prompt_logprobs=plp, outputs=outputs, finished=all(s.finished for s in seqs),
                         num_cached_tokens=first.num_cached_tokens, metrics=request_metrics(seqs))


def request_metrics(seqs: list[Sequence]) -> RequestMetrics:
    """The request's timestamps over its sequences (earliest start events, latest end events)."""
    if len(seqs) == 1:
        s = seqs[0]
        return RequestMetrics(arrival_time=s.arrival_time, first_scheduled_time=s.first_scheduled_time,
                              first_token_time=s.first_token_time, last_token_time=s.last_token_time,
                              finished_time=s.finished_time if s.finished else None)

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


class OutputAccumulator:
    """Adds up the deltas of requests into their whole outputs in O(new items) per delta: ``add(delta)`` records a
    delta, ``pop(request_id)`` returns the request's whole output so far (text joined, token ids and logprobs
    concatenated, the rest from the latest delta) and forgets it."""

    def __init__(self) -> None:
        self._latest: dict[str, RequestOutput] = {}
        self._parts: dict[str, dict] = {}

    def add(self, delta: RequestOutput) -> None:
        parts = self._parts.setdefault(delta.request_id, {"prompt_logprobs": None, "outputs": {}})
        if delta.prompt_logprobs is not None:
            parts["prompt_logprobs"] = (parts["prompt_logprobs"] or []) + list(delta.prompt_logprobs)
        for c in delta.outputs:
            text, ids, lps = parts["outputs"].setdefault(c.index, ([], [], None))
            text.append(c.text)
            ids.extend(c.token_ids)
            if c.logprobs is not None:
                lps = (lps if lps is not None else [])
                lps.extend(c.logprobs)
                parts["outputs"][c.index] = (text, ids, lps)
        self._latest[delta.request_id] = delta

    def pop(self, request_id: str) -> RequestOutput | None:
        delta = self._latest.pop(request_id, None)
        if delta is None:
            return None
        parts = self._parts.pop(request_id)
        outputs = []
        for c in delta.outputs:
            text, ids, lps = parts["outputs"][c.index]
            outputs.append(replace(c, text="".join(text), token_ids=ids, logprobs=lps))
        return replace(delta, prompt_token_ids=list(delta.prompt_token_ids), prompt_logprobs=parts["prompt_logprobs"],
                       outputs=outputs)
