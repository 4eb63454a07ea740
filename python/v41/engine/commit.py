"""Committing a sampled token to a sequence, in two halves (docs/architecture.md §3 "The step"):

* :func:`append_token` appends the id (with its time and logprob entry) and applies the stop conditions that need
  no text: EOS, a stop token id, ``max_tokens``;
* :func:`read_text` feeds the ids appended since its last call to the sequence's incremental detokenizer, where a
  stop string may end the sequence (a stop string wins over ``max_tokens`` on the same token, as in vLLM), and
  flushes the held-back text of a sequence that has ended.

A synchronous engine step runs both per token. With ``async_output_proc`` the engine appends a step's tokens when
they are sampled and reads their text in the next call, while the GPU runs that call's step
(:meth:`~v41.engine.core.EngineCore.step`). Also here: the logprob entries recorded with them (prompt logprobs,
the verify rows of speculative steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import torch

from .request import Sequence
from .sampler import compute_prompt_logprobs, gather_logprobs


def append_token(seq: Sequence, tok: int, lp, eos_token_ids: Collection[int]) -> None:
    """Append ``tok`` (and its logprob entry ``lp``, a ``{id: Logprob}`` dict or None) to a running sequence;
    EOS (unless ``ignore_eos``) or a stop token id ends it with ``stop``, and its text skips that id; reaching
    ``max_tokens`` ends it with ``length``."""
    p = seq.params
    seq.output_token_ids.append(tok)
    seq.last_token_time = time.time()
    if seq.first_token_time is None:
        seq.first_token_time = seq.last_token_time
    if seq.logprobs is not None and lp is not None:
        seq.logprobs.append(lp)
        seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + lp[tok].logprob
    is_eos = tok in eos_token_ids and not p.ignore_eos
    is_stop_id = tok in p.stop_token_id_list
    if is_eos or is_stop_id:
        seq.finish_reason, seq.stop_reason = "stop", (tok if is_stop_id else None)
        seq.text_upto = len(seq.output_token_ids)  # never detokenized
    elif len(seq.output_token_ids) >= seq.max_tokens:
        seq.finish_reason = "length"


def read_text(seq: Sequence) -> bool:
    """Detokenize the ids appended since the last call; True when a stop string ended the sequence here. A
    sequence that has ended is flushed (its held-back text released; idempotent)."""
    new = seq.output_token_ids[seq.text_upto:]
    seq.text_upto = len(seq.output_token_ids)
    stopped = False
    if new and seq.finish_reason in (None, "length"):
        _, hit = seq.detok.push(new)
        if hit is not None:
            stopped = seq.finish_reason is None
            seq.finish_reason, seq.stop_reason = "stop", hit
    if seq.finished:
        seq.detok.flush()
    return stopped


def record_prompt_logprobs(seq: Sequence, logits: torch.Tensor, start: int, decode: Callable[[int], str]) -> None:
    """Record prompt logprobs for positions start+1.. (row i of ``logits`` [n, V] predicts prompt token
    start+1+i). Positions already recorded (a preempted sequence recomputes its prompt) are kept, not appended
    twice."""
    ids = seq.prompt_token_ids[start:start + logits.shape[0] + 1]
    entries = compute_prompt_logprobs(logits, ids, seq.params.prompt_logprobs, decode)
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)
    for pos, entry in enumerate(entries[1:], start=start + 1):
        if pos == len(seq.prompt_logprobs):
            seq.prompt_logprobs.append(entry)


def verify_logprobs(seq: Sequence, logits: torch.Tensor, toks: list[int], decode: Callable[[int], str]) -> list:
    """Logprob entries of ``toks`` committed from verify rows ``logits`` [≥ len(toks), V] (the raw model
    distribution, as the sampler reports), or Nones when the request asked for none."""
    n = seq.params.logprobs
    if n is None:
        return [None] * len(toks)
    lp = torch.log_softmax(logits[: len(toks)].float(), dim=-1)
    return gather_logprobs(lp, torch.tensor(toks), n).to_dicts([n] * len(toks), decode)
