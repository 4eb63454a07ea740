"""The context limit the KV cache can honour: ``max_model_len`` capped to the longest request (prompt + output
tokens) whose peak footprint fits every cache pool at once, so that every advertised length is servable and
no request within it is refused for want of blocks.

The footprint rule belongs to the Rust scheduler (``Scheduler::footprint_blocks`` in crates/v41-sched: an
unbounded kind holds every block up to the last fed position; a windowed kind the window plus one prefill
chunk). Rather than restate it, :func:`max_request_tokens` asks a scratch scheduler built with the engine's
layout and limits whether a request of a given length could ever be admitted (``add_request`` refuses one
that could not), bisecting on the length: about log2(max_model_len) probes, each O(prompt), at start-up only.
"""

from __future__ import annotations

import logging

from .. import _native
from .args import EngineArgs

log = logging.getLogger("v41.engine")


def max_request_tokens(sched_layout: list[dict], args: EngineArgs, limit: int) -> int:
    """The largest ``n <= limit`` (tokens: prompt + max_tokens) such that one request of ``n`` tokens fits
    every pool of ``sched_layout`` (``CacheLayout.scheduler_layout(num_blocks)``) with the scheduling limits
    of ``args``; 1 when not even a 2-token request (1 prompt token, 1 output token) fits."""

    probe = _native.Scheduler(sched_layout, max_num_batched_tokens=args.max_num_batched_tokens,
                              max_num_seqs=args.max_num_seqs, max_model_len=limit,
                              long_prefill_token_threshold=args.long_prefill_token_threshold,
                              enable_prefix_caching=False)

    def fits(n: int) -> bool:
        try:
            probe.add_request(n, [0] * (n - 1), 1)  # the id is the length: every probe is a new request
        except ValueError:  # the only refusal left within max_model_len: a pool it could never fit
            return False
        probe.abort_request(n)
        return True

    if fits(limit):
        return limit
    lo, hi = 1, limit  # fits(lo) or lo == 1; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def cap_max_model_len(wanted: int, args: EngineArgs, sched_layout: list[dict], limit: int) -> tuple[int, int]:
    """(``wanted`` tokens lowered to what the KV cache holds for one request, the longest request it holds alone
    up to ``max(wanted, limit)`` tokens) — one bisection (:func:`max_request_tokens`) gives both.

    Raises ValueError naming both numbers when ``args.max_model_len`` was set explicitly above that, and when
    the cache cannot hold even a 2-token request; a default that does not fit is capped with a warning."""
    longest = max_request_tokens(sched_layout, args, max(wanted, limit))
    fits = min(wanted, longest)
    if fits == wanted:
        return wanted, longest
    kinds = [k for k in sched_layout if "num_blocks" in k]
    counts = {k["num_blocks"] for k in kinds}
    pools = f"{counts.pop()} blocks" if len(counts) == 1 else \
        "/".join(f"{k['num_blocks']} {k['name']}" for k in kinds) + " blocks"
    cache = (f"the KV cache ({pools} of {kinds[0]['tokens_per_block']} tokens per kind) holds at most {fits} "
             "tokens of one request")
    hint = "raise kv_cache_bytes / gpu_memory_utilization (or lower max_num_batched_tokens)"
    if fits < 2:
        raise ValueError(f"{cache}: not even a 1-token prompt and 1 output token; {hint}")
    if args.max_model_len is not None:
        raise ValueError(f"max_model_len {wanted} tokens does not fit: {cache}; set max_model_len <= {fits} "
                         f"or {hint}")
    log.warning("max_model_len capped from %d to %d tokens: %s", wanted, fits, cache)
    return fits, longest
