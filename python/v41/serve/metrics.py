"""Prometheus metrics of one server (``GET /metrics``), on a registry of their own (not the global one), so
several apps in one process (tests) never share or clash.

Request-level figures are measured in the front end, per engine request, from the arrival of the HTTP
request: TTFT (arrival → first generated token), inter-token latency (TPOT: gap between token deliveries,
split evenly when one delivery carries several tokens), end-to-end latency (arrival → terminal output) and
queue time (engine arrival → first scheduled, only when the engine reports ``RequestOutput.metrics``).
Engine-level gauges (running/waiting, KV blocks per cache kind, prefix hit rate) are refreshed from the
engine's ``stats()`` at every scrape. All times are seconds.

KV blocks of each cache kind are split by holder (:func:`kv_blocks`): *used* by running requests (some may be
shared with the prefix cache), *cached* (held only by the prefix cache: evictable, so an idle server shows 0
used), free. ``v41_kv_cache_usage_ratio`` is used / total, as vLLM's KV usage (evictable blocks count as free).

Speculative decoding (docs/speculative-decoding.md "Metrics"), vLLM's counters under the ``v41_`` prefix:
``v41_spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
``..._num_accepted_tokens_per_pos_total{position}`` (position 0-based, as vLLM's). They follow the engine's
cumulative counts (``stats()["spec_decode"]``: every sequence since start, running ones included): each scrape
adds what those counts grew by since the previous one, so every verify step is counted exactly once (a running
request's steps as they happen, not again when it ends). They stay 0 while the engine does not speculate.

Engram offload (docs/engram.md "Metrics"), rank 0's pager: ``v41_engram_lookups_total`` (distinct table rows per
step and layer), ``v41_engram_hits_total`` (of those, already in the device cache), ``v41_engram_evictions_total``
(cached rows replaced), advanced by what the engine's cumulative counts grew, and the gauge
``v41_engram_copy_seconds``: host seconds since start spent planning and issuing the copies of misses before the
steps' forwards (the copy time a step is exposed to). They stay 0 without offload.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.params import RequestOutput
from ..engine.spec_stats import SpecDecodeStats

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                        0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)

METRIC_NAMES = (
    "v41_requests_total", "v41_request_errors_total", "v41_time_to_first_token_seconds",
    "v41_time_per_output_token_seconds", "v41_e2e_request_latency_seconds", "v41_request_queue_time_seconds",
    "v41_num_requests_running", "v41_num_requests_waiting", "v41_kv_cache_usage_ratio",
    "v41_kv_cache_used_blocks", "v41_kv_cache_cached_blocks", "v41_kv_cache_total_blocks",
    "v41_prefix_cache_hit_rate", "v41_prompt_tokens_total", "v41_generation_tokens_total", "v41_engine_alive",
    "v41_spec_decode_num_drafts_total", "v41_spec_decode_num_draft_tokens_total",
    "v41_spec_decode_num_accepted_tokens_total", "v41_spec_decode_num_accepted_tokens_per_pos_total",
    "v41_engram_lookups_total", "v41_engram_hits_total", "v41_engram_evictions_total", "v41_engram_copy_seconds",
)
_ENGRAM_COUNTS = ("lookups", "hits", "evictions")


class ServerMetrics:
    """The metrics of one server; ``registry`` is its own :class:`CollectorRegistry`."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("v41_requests", "Finished completions by finish reason.", ["finish_reason"],
                                registry=r)
        self.errors = Counter("v41_request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=r)
        self.ttft = Histogram("v41_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("v41_time_per_output_token_seconds", "Gap between consecutive output tokens.",
                              buckets=_TOKEN_GAP_BUCKETS_S, registry=r)
        self.e2e = Histogram("v41_e2e_request_latency_seconds", "Arrival to the terminal output.",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue = Histogram("v41_request_queue_time_seconds", "Engine arrival to first scheduled.",
                               buckets=_LATENCY_BUCKETS_S, registry=r)
        self.running = Gauge("v41_num_requests_running", "Requests in the engine's running batch.", registry=r)
        self.waiting = Gauge("v41_num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("v41_kv_cache_usage_ratio", "KV blocks held by running requests / total, per "
                              "cache kind (blocks held only by the prefix cache count as free).", ["kind"],
                              registry=r)
        self.kv_used = Gauge("v41_kv_cache_used_blocks", "KV blocks held by running requests (some may be shared "
                             "with the prefix cache), per cache kind.", ["kind"], registry=r)
        self.kv_cached = Gauge("v41_kv_cache_cached_blocks", "KV blocks held only by the prefix cache (evictable), "
                               "per cache kind.", ["kind"], registry=r)
        self.kv_total = Gauge("v41_kv_cache_total_blocks", "KV blocks per cache kind (cstate: state rows).",
                              ["kind"], registry=r)
        self.prefix_hit_rate = Gauge("v41_prefix_cache_hit_rate", "Prefix-cache hit rate (tokens).", registry=r)
        self.prompt_tokens = Counter("v41_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("v41_generation_tokens", "Generated tokens.", registry=r)
        self.alive = Gauge("v41_engine_alive", "1 while the engine is alive and making progress.", registry=r)
        self.spec_drafts = Counter("v41_spec_decode_num_drafts", "Speculative verify steps with at least one draft "
                                   "token.", registry=r)
        self.spec_draft_tokens = Counter("v41_spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.spec_accepted_tokens = Counter("v41_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("v41_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted "
                                             "at each position of the draft block (0-based).", ["position"],
                                             registry=r)
        self._spec_seen = SpecDecodeStats()  # the engine's counts at the previous scrape
        self.engram = {k: Counter(f"v41_engram_{k}", f"Engram offload: {what}.", registry=r) for k, what in zip(
            _ENGRAM_COUNTS, ("distinct table rows looked up per step and layer", "lookups already in the device "
                             "row cache", "cached rows replaced"))}
        self.engram_copy_seconds = Gauge("v41_engram_copy_seconds", "Engram offload: host seconds since start "
                                         "spent planning and issuing the copies of misses before the forwards.",
                                         registry=r)
        self._engram_seen = dict.fromkeys(_ENGRAM_COUNTS, 0)

    def track(self, arrival_s: float | None = None) -> RequestTracker:
        """A tracker for one engine request that arrived at ``arrival_s`` (``time.monotonic``; default now)."""
        return RequestTracker(self, time.monotonic() if arrival_s is None else arrival_s)

    def record_error(self, http_status: int) -> None:
        self.errors.labels(status=str(http_status)).inc()

    def update_engine(self, stats: dict | None, alive: bool) -> None:
        """Refresh the engine gauges from a ``stats()`` dict (running, waiting, blocks{kind: used/cached/free/
        total}, prefix_hit_rate) and advance the spec-decode counters (``spec_decode``, when the engine
        speculates) and the Engram ones (``engram``, with offload); None leaves them as they are."""
        self.alive.set(1.0 if alive else 0.0)
        if not stats:
            return
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0))
        for kind, pool in kv_blocks(stats).items():
            total = pool["total"]
            self.kv_usage.labels(kind=kind).set(pool["used"] / total if total else 0.0)
            self.kv_used.labels(kind=kind).set(pool["used"])
            self.kv_cached.labels(kind=kind).set(pool["cached"])
            self.kv_total.labels(kind=kind).set(total)
        if stats.get("prefix_hit_rate") is not None:
            self.prefix_hit_rate.set(stats["prefix_hit_rate"])
        if stats.get("spec_decode") is not None:
            self._advance_spec_decode(SpecDecodeStats.from_dict(stats["spec_decode"]))
        engram = stats.get("engram")
        if engram is not None and all(engram[k] >= self._engram_seen[k] for k in _ENGRAM_COUNTS):
            for k in _ENGRAM_COUNTS:
                self.engram[k].inc(engram[k] - self._engram_seen[k])
                self._engram_seen[k] = engram[k]
            self.engram_copy_seconds.set(engram["copy_seconds"])

    def _advance_spec_decode(self, total: SpecDecodeStats) -> None:
        """Add to the spec-decode counters what the engine's cumulative counts ``total`` grew by since the last
        call (module doc)."""
        grown = total.since(self._spec_seen)
        counts = (grown.num_drafts, grown.num_draft_tokens, grown.num_accepted_tokens, *grown.accepted_per_position)
        if min(counts) < 0:  # an older snapshot than the last one (a stale stats fallback): nothing new in it
            return
        self._spec_seen = total
        self.spec_drafts.inc(grown.num_drafts)
        self.spec_draft_tokens.inc(grown.num_draft_tokens)
        self.spec_accepted_tokens.inc(grown.num_accepted_tokens)
        for position, n in enumerate(grown.accepted_per_position):
            self.spec_accepted_per_pos.labels(position=str(position)).inc(n)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def kv_blocks(stats: dict) -> dict[str, dict[str, int]]:
    """Per cache kind of an engine ``stats()`` dict: ``{"used", "cached", "free", "total"}`` blocks (rows for
    ``cstate``), where ``used`` counts blocks held by running requests and ``cached`` blocks held only by the
    prefix cache (evictable); used + cached + free = total.

    The scheduler's pools report ``used`` (any holder) and ``cached`` (``v41._native`` built from
    crates/v41-sched with ``PoolStats::cached_only``). An extension built before that reports no ``cached``:
    then nothing is split while requests run (used = every held block, as before), and when none runs every
    held block is the prefix cache's (finished requests leave blocks only to the cache), which is exact."""
    idle = not stats.get("running")
    out = {}
    for kind, pool in (stats.get("blocks") or {}).items():
        held, total = int(pool.get("used", 0)), int(pool.get("total", 0))
        cached = int(pool["cached"]) if "cached" in pool else (held if idle else 0)
        out[kind] = {"used": held - cached, "cached": cached, "free": int(pool.get("free", total - held)),
                     "total": total}
    return out


class RequestTracker:
    """Latency and token accounting of one engine request (n completions); feed it every delta output."""

    def __init__(self, metrics: ServerMetrics, arrival_s: float):
        self.m = metrics
        self.arrival_s = arrival_s
        self.last_token_s: float | None = None
        self.prompt_counted = False
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        """Account one delta output (``outputs[i].token_ids`` hold only new tokens)."""
        now = time.monotonic()
        if not self.prompt_counted:
            self.prompt_counted = True
            self.m.prompt_tokens.inc(len(out.prompt_token_ids))
            mt = out.metrics
            if mt is not None and mt.first_scheduled_time is not None:
                self.m.queue.observe(max(0.0, mt.first_scheduled_time - mt.arrival_time))
        new = sum(len(c.token_ids) for c in out.outputs)
        if new:
            self.m.generation_tokens.inc(new)
            if self.last_token_s is None:
                self.m.ttft.observe(now - self.arrival_s)
                new -= 1  # the first token is TTFT, not an inter-token gap
            if new > 0 and self.last_token_s is not None:
                gap = (now - self.last_token_s) / new
                for _ in range(new):
                    self.m.tpot.observe(gap)
            self.last_token_s = now
        if out.finished and not self.done:
            self.done = True
            self.m.e2e.observe(now - self.arrival_s)
            for c in out.outputs:
                self.m.requests.labels(finish_reason=c.finish_reason or "abort").inc()

    def on_abandoned(self) -> None:
        """The request ended without a terminal output (client gone, error): count it as aborted."""
        if not self.done:
            self.done = True
            self.m.requests.labels(finish_reason="abort").inc()
