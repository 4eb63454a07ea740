"""The engine core: one loop of schedule (Rust) → run (paged model) → sample → detokenize and stop → report.

With async scheduling (the default where it applies: one process, no speculation, no Engram offload) the loop is
pipelined: step N + 1 is planned and launched while step N still runs on the GPU, with placeholders for step N's
sampled ids that the device fills (:mod:`.pending`); step N's ids are then read, committed and reported while
step N + 1 runs. A request that stops at step N has one more token computed and discarded.

Every accepted request ends with exactly one terminal output (finish reason stop, length or abort); its
blocks are freed by the scheduler when it finishes, is aborted or is preempted (recomputed later).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .. import _native
from ..cache import blocks_for_budget
from ..config import load_config
from ..models.engram_loader import engram_hasher
from .args import EngineArgs
from .commit import append_token, read_text, record_prompt_logprobs, verify_logprobs
from .context_limit import cap_max_model_len
from .detokenizer import IncrementalDetokenizer
from .engram_rows import StepRowHasher
from .executor import make_executor
from .host_step import plan_host_step
from .output import delta_output
from .pending import PENDING_TOKEN, PendingResolver, needs_output_ids
from .params import RequestOutput, SamplingParams
from .prompts import validate_request
from .request import Sequence
from .sampler import Sampler, SamplingState
from .spec_decode import SpecDecoder
from .spec_stats import SpecDecodeStats

log = logging.getLogger("v41.engine")
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class _Launched:
    """A step queued on the device (:meth:`EngineCore._launch`), waiting for :meth:`EngineCore._complete`."""

    plan: object
    req_ids: list[int]
    seqs: list[Sequence]
    sample_rows: list
    logits: torch.Tensor | None  # kept for the verify rows of a speculative step only (None otherwise)
    row_of: dict[int, int]
    sampling: list
    plain: list
    out: object  # the sampler's output, copied to the host without waiting (SamplerOutput.to_host)
    sampled: torch.Tensor | None  # the sampled ids of ``plain`` on the device (the next step's pending rows)


class EngineCore:
    """Owns the model, the paged cache, the scheduler and every live sequence.

    ``add_request`` validates and enqueues; ``step`` advances every scheduled sequence by one step and returns
    what is new for each request that changed (delta :class:`RequestOutput` s, :mod:`.output`); ``abort_request``
    ends a request now.
    Errors: ValueError for bad requests (the message says what is wrong); nothing is enqueued then. At
    construction: ValueError for bad options, ``speculative_config`` included (checked against the checkpoint
    before any weight is loaded: :meth:`~v41.engine.spec_config.SpeculativeConfig.check`).
    """

    def __init__(self, args: EngineArgs):
        args.validate()
        if args.speculative_config is not None:
            args.speculative_config.check(load_config(args.model, args.hf_overrides), args.tensor_parallel_size)
        self.args = args
        dtype = args.torch_dtype()
        self.executor = make_executor(args)
        try:
            self.cfg, self.device = self.executor.cfg, self.executor.device
            self.tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
            self.max_model_len = args.max_model_len or min(self.cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
            hasher = engram_hasher(self.cfg, Path(args.model) / "tokenizer.json")
            self.engram_rows = StepRowHasher(hasher) if hasher is not None else None
            self.layout = layout = self.executor.cache_layout(args.block_size)
            budget = self._cache_budget(dtype)
            num_blocks = args.num_kv_blocks or blocks_for_budget(layout, budget, args.max_num_seqs, dtype.itemsize)
            self.max_model_len, longest = cap_max_model_len(self.max_model_len, args,
                                                            layout.scheduler_layout(num_blocks),
                                                            self.cfg.max_position_embeddings)
            self.executor.init_cache(num_blocks, args.max_num_seqs, layout.block_tokens, self.max_model_len)
            self.num_blocks = num_blocks
        except BaseException:
            self.executor.shutdown()
            raise
        sched_layout = layout.scheduler_layout(num_blocks) + [{"name": "cstate", "state_rows": args.max_num_seqs}]
        self.scheduler = _native.Scheduler(
            sched_layout, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len, long_prefill_token_threshold=args.long_prefill_token_threshold,
            enable_prefix_caching=args.enable_prefix_caching)
        self.sampler = Sampler(self.cfg.eos_token_ids)
        spec = args.speculative_config
        self.spec = SpecDecoder(spec, self.executor, self.sampler) if spec is not None else None
        # draws the sampling key of requests that bring no seed (reproducible engine runs when args.seed is set)
        self._seeds = random.Random(args.seed) if args.seed is not None else random.SystemRandom()
        self.seqs: dict[int, Sequence] = {}
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count(1)
        self._deferred: dict[int, list[Sequence]] = {}
        self._spec_done = SpecDecodeStats()  # the counts of every sequence that has left self.seqs
        self._unreported: set[str] = set()  # requests with news not yet reported (step → _read_out)
        self._async_output = args.async_output_proc and self.spec is None  # one token per step per sequence
        self._async_scheduling = (self._async_output and args.async_scheduling and args.tensor_parallel_size == 1
                                  and self.executor.runner.engram is None)
        self._inflight: _Launched | None = None  # async scheduling: the step launched by the last call
        if self._async_scheduling:
            self.executor.runner.resolver = PendingResolver(
                self.device, self.engram_rows.hasher if self.engram_rows else None, self.cfg.vocab_size)
        log.info("engine ready: %d blocks of %d tokens per kind, kinds %s", num_blocks, layout.block_tokens,
                 [k.name for k in layout.kinds])
        stored = str(dtype).removeprefix("torch.") if args.resolved_kv_cache_dtype() == "auto" else "fp8 records"
        log.info("KV cache (%s): bytes per token per kind: %s; the longest request that fits alone: %d tokens "
                 "(max_model_len %d)", stored, layout.describe(dtype.itemsize), longest, self.max_model_len)

    def _cache_budget(self, dtype: torch.dtype) -> int:
        if not str(self.device).startswith("cuda"):
            return self.args.kv_cache_bytes
        free, total = torch.cuda.mem_get_info(torch.device(self.device))
        used = total - free + self.executor.runner.graph_output_bytes()  # captured after the cache is sized
        budget = int(total * self.args.gpu_memory_utilization) - used
        if budget <= 0:
            raise ValueError(f"no room for the KV cache: gpu_memory_utilization={self.args.gpu_memory_utilization} "
                             f"of {total / 2**30:.1f} GiB allows {total * self.args.gpu_memory_utilization / 2**30:.1f}"
                             f" GiB, but {used / 2**30:.1f} GiB are in use on the device (weights and other "
                             "processes); raise gpu_memory_utilization or free the GPU")
        return budget

    # -- requests ------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, *, priority: int = 0, cache_salt: str | None = None) -> None:
        """Enqueue a request (n sequences).

        priority: lower runs first (vLLM's convention): the scheduler admits waiting requests by
        (priority, arrival) and preempts the highest value, latest arrival first. cache_salt: a prefix-cache
        namespace (vLLM ``cache_salt``, SGLang ``extra_key``): a request reuses cached prefix blocks only of
        requests with the same salt; None is the shared default namespace. A salt isolates only as well as
        it is secret: whoever sends the same salt shares the cache (and sees hits in ``num_cached_tokens``).
        Ignored with prompt_logprobs (every position is computed) and without prefix caching.
        Raises ValueError for an empty or too long prompt, ids outside the vocabulary, a duplicate id, a
        priority outside int32, a salt that is empty, no string or not UTF-8, or invalid sampling
        parameters (``n`` above ``args.max_n`` included)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = [int(t) for t in prompt_token_ids]
        max_tokens = validate_request(ids, params, priority, cache_salt, self.cfg.vocab_size, self.max_model_len,
                                      self.args.max_n)
        seqs: list[Sequence] = []
        try:
            for i in range(params.n):
                p = params if params.n == 1 else params.child(i)
                sid = next(self._ids)
                # Prompt logprobs need every prompt position computed: no prefix hit for such sequences.
                # User salts get a prefix that the engine's own ("\x00…") cannot have.
                salt = (f"\x00prompt-logprobs-{sid}" if p.prompt_logprobs is not None
                        else f"user:{cache_salt}" if cache_salt else None)
                if i == 0 or not self.args.enable_prefix_caching:
                    self.scheduler.add_request(sid, ids, max_tokens, priority=priority, cache_salt=salt,
                                               lookahead=self.args.lookahead_tokens())
                seqs.append(Sequence(
                    request_id=request_id, index=i, seq_id=sid, prompt=prompt, prompt_token_ids=ids, params=p,
                    sampling=SamplingState.create(p, ids, seed=self._seeds.getrandbits(64)),
                    detok=IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens, p.stop_strings,
                                                 p.include_stop_str_in_output),
                    prompt_logprobs=[] if p.prompt_logprobs is not None else None,
                    logprobs=[] if p.logprobs is not None else None, max_tokens=max_tokens, salt=salt,
                    priority=priority, spec_decode=SpecDecodeStats.empty(self.spec.k) if self.spec else None))
        except ValueError:
            for s in seqs:
                if s.seq_id in self.scheduler:
                    self.scheduler.abort_request(s.seq_id)
            raise
        self.requests[request_id] = seqs
        self.seqs.update({s.seq_id: s for s in seqs})
        # n > 1 with prefix caching: the other completions start once the first has computed the prompt,
        # so they reuse its cached prefix blocks instead of prefilling it again.
        self._deferred.update({seqs[0].seq_id: [s for s in seqs[1:] if s.seq_id not in self.scheduler]})

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now (finish reason ``abort``); returns its terminal output, None if unknown."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return None
        self._unreported.discard(request_id)
        for s in seqs:
            self._deferred.pop(s.seq_id, None)
            if read_text(s) and s.seq_id in self.scheduler:  # async_output_proc: the last step's text; a stop
                self.scheduler.finish_request(s.seq_id)        # string there ends the sequence as "stop"
            if not s.finished:
                s.finish_reason = "abort"
                if s.seq_id in self.scheduler:
                    self.scheduler.abort_request(s.seq_id)
        return self._report(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that changed (terminal outputs at most once). With
        ``async_output_proc`` the text of a step's tokens is read, and the requests reported, by the next call
        while the GPU runs that call's step; with async scheduling a step is left running when the call returns
        and its ids are committed by the next call (module docstring)."""
        prev, self._inflight = self._inflight, None
        if prev is not None and not self._hold(prev):
            self._complete(prev)
            prev = None
        try:
            plan = self.scheduler.step()
            launched = self._launch(plan, prev) if plan.num_tokens else None
        finally:  # also when planning or launching raises: the held placeholders get their ids
            if prev is not None:
                self._complete(prev, held=True)
        for sid, reason in plan.finished:
            seq = self.seqs.get(sid)
            if seq is not None and not seq.finished:
                seq.finish_reason = "length" if reason == "length" else reason
                self._unreported.add(seq.request_id)
        if launched is not None and not self._async_output:
            self._complete(launched)
            launched = None
        outs = self._read_out()
        if launched is not None:
            if self._async_scheduling:
                self._inflight = launched
            else:
                self._complete(launched)
        return outs

    def _hold(self, l: _Launched) -> bool:
        """Async scheduling: report placeholders for the sampled ids of the running step ``l`` so the next step
        can be planned before they are known. False (nothing reported) when a sampled row's next logits need its
        output ids (penalties) or ``l`` verified drafts."""
        if any(needs_output_ids(s.params) or len(l.sample_rows[r]) > 1 for r, s in l.sampling):
            return False
        sampled = {s.seq_id for _, s in l.plain}
        ids = [sid for sid in l.req_ids if sid in self.scheduler]
        self.scheduler.update_from_output(ids, [[PENDING_TOKEN] if sid in sampled else [] for sid in ids])
        for _, s in l.plain:
            s.sampling.pending = 1
        return True

    def _read_out(self) -> list[RequestOutput]:
        """Detokenize what was committed since the last read (a stop string ends its sequence here) and report
        every request that changed."""
        touched, self._unreported = self._unreported, set()
        for rid in sorted(touched):
            for seq in self.requests.get(rid, ()):
                if read_text(seq) and seq.seq_id in self.scheduler:
                    self.scheduler.finish_request(seq.seq_id)
        return [out for rid in sorted(touched) if (out := self._report(rid)) is not None]

    def _launch(self, plan, prev: _Launched | None = None) -> _Launched:
        """Queue the step's forward and its sampling on the device (prompt logprobs are read here, before a later
        step's graph replay reuses the logits); nothing waits for the sampled ids. ``prev``: the running step
        whose sampled ids are this step's pending input ids (async scheduling)."""
        req_ids = plan.req_ids.tolist()
        seqs = [self.seqs[sid] for sid in req_ids]
        prev_rows = {s.seq_id: i for i, (_, s) in enumerate(prev.plain)} if prev is not None else None
        step, sample_rows, prompt_rows, pending = plan_host_step(plan, seqs, self.engram_rows, prev_rows,
                                                                 prev.sampled if prev is not None else None)
        logits = self.executor.execute(step, pending) if pending is not None else self.executor.execute(step)
        row_of = {int(r): i for i, r in enumerate(step.logits_rows.tolist())}
        for r, seq in enumerate(seqs):
            if prompt_rows[r] is not None and seq.prompt_logprobs is not None:
                record_prompt_logprobs(seq, logits[[row_of[x] for x in prompt_rows[r]]], int(plan.start_pos[r]),
                                       self._decode_token)
        sampling = [(r, seqs[r]) for r in range(len(seqs)) if sample_rows[r] is not None]
        plain = [(r, s) for r, s in sampling if len(sample_rows[r]) == 1]
        out = sampled = None
        if plain:
            rows = [row_of[sample_rows[r][0]] for r, _ in plain]
            picked = logits if rows == list(range(logits.shape[0])) else logits[rows]  # a decode step: all rows
            out = self.sampler(picked, [s.sampling for _, s in plain])
            sampled, out = out.sampled_token_ids, out.to_host()
        keep = logits if self.spec is not None else None  # an in-flight step must not pin a prefill's logits
        return _Launched(plan, req_ids, seqs, sample_rows, keep, row_of, sampling, plain, out, sampled)

    def _complete(self, l: _Launched, held: bool = False) -> None:
        """Wait for the step's sampled ids and commit them (with ``async_output_proc``: append them; their text is
        read by the next :meth:`_read_out`), verify drafts, update the scheduler. ``held``: :meth:`_hold` reported
        placeholders for them, which the ids replace."""
        touched, req_ids, sample_rows, row_of = self._unreported, l.req_ids, l.sample_rows, l.row_of
        sampled_lists: dict[int, list[int]] = {sid: [] for sid in req_ids}
        accepted: dict[int, int] = {sid: 0 for sid in req_ids}
        finished_now = []
        if l.plain:
            l.out.wait()
            lps = l.out.row_logprobs([s.sampling for _, s in l.plain], self._decode_token)
            for (r, seq), tok, lp in zip(l.plain, l.out.sampled_token_ids.tolist(), lps):
                seq.sampling.pending = 0
                if not seq.finished:
                    if held:
                        self.scheduler.set_last_token(seq.seq_id, tok)
                    sampled_lists[seq.seq_id] = [tok]
                    self._commit_all(seq, [tok], [lp], touched, finished_now)
        verifying = [(r, s) for r, s in l.sampling if len(sample_rows[r]) > 1 and not s.finished]
        if verifying:  # k drafts verified: commit the accepted ones, then the target's token
            rows = [[row_of[x] for x in sample_rows[r]] for r, _ in verifying]
            verify_logits = l.logits[[x for rr in rows for x in rr]]
            counts = [len(rr) - 1 for rr in rows]
            commits = self.spec.verify([s for _, s in verifying], verify_logits, counts)
            first = 0
            for (r, seq), toks, c in zip(verifying, commits, counts):
                sampled_lists[seq.seq_id], accepted[seq.seq_id] = toks, len(toks) - 1
                seq.spec_decode.add_block(c, len(toks) - 1)  # before any stop cuts it
                lps = verify_logprobs(seq, verify_logits[first:first + c + 1], toks, self._decode_token)
                self._commit_all(seq, toks, lps, touched, finished_now)
                first += c + 1
        drafts = None
        if self.spec is not None:
            going = [(r, s) for r, s in l.sampling if not s.finished]
            new = self.spec.draft([s for _, s in going], [int(l.plan.table_rows[r]) for r, _ in going])
            by_id = {s.seq_id: d for (_, s), d in zip(going, new)}
            drafts = [by_id.get(sid) for sid in req_ids]
        live = [i for i, sid in enumerate(req_ids) if sid in self.scheduler]  # a stop string may have ended some
        if not held:
            self.scheduler.update_from_output([req_ids[i] for i in live], [sampled_lists[req_ids[i]] for i in live],
                                              [accepted[req_ids[i]] for i in live],
                                              None if drafts is None else [drafts[i] for i in live])
        for seq in finished_now:
            if seq.seq_id in self.scheduler:
                self.scheduler.finish_request(seq.seq_id)
        for _, seq in l.sampling:
            for child in self._deferred.pop(seq.seq_id, []):
                if not child.finished:
                    self.scheduler.add_request(child.seq_id, child.prompt_token_ids, child.max_tokens,
                                               priority=child.priority, cache_salt=child.salt,
                                               lookahead=self.args.lookahead_tokens())

    def _commit_all(self, seq: Sequence, toks: list[int], lps: list, touched: set[str],
                    finished_now: list[Sequence]) -> None:
        """Commit ``toks`` in order until the sequence stops (the rest is dropped unstreamed); with
        ``async_output_proc`` (one token per step) the text is left for the next :meth:`_read_out`."""
        for tok, lp in zip(toks, lps):
            if seq.finished:
                return
            self._commit(seq, tok, lp)
            touched.add(seq.request_id)
            if seq.finished:
                finished_now.append(seq)

    def _commit(self, seq: Sequence, tok: int, lp) -> None:
        """Append one sampled token (:mod:`.commit`); a synchronous step reads its text at once."""
        append_token(seq, tok, lp, self.cfg.eos_token_ids)
        if not self._async_output:
            read_text(seq)

    def _decode_token(self, tok: int) -> str:
        return self.tokenizer.decode([tok], skip_special_tokens=False)

    def _report(self, request_id: str) -> RequestOutput | None:
        seqs = self.requests.get(request_id)
        if seqs is None:
            return None
        now = time.time()
        for s in seqs:
            if s.finished and s.finished_time is None:
                s.finished_time = now
        out = delta_output(seqs)
        if out.finished:
            for s in seqs:
                self.seqs.pop(s.seq_id, None)
                if s.spec_decode is not None:
                    self._spec_done.merge(s.spec_decode)
            del self.requests[request_id]
        return out

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at TP=1). The engine is unusable afterwards."""
        self.executor.shutdown()

    def stats(self) -> dict:
        """Scheduler statistics (running, waiting, blocks per kind, prefix hit rate), while speculating
        ``spec_decode``: :meth:`spec_decode_stats` as :meth:`SpecDecodeStats.to_dict`, and with Engram offload
        ``engram``: rank 0's paging counters (:meth:`~.engram_pager.EngramPager.stats`; every rank pages its own
        hash columns alike)."""
        stats = self.scheduler.stats()
        spec = self.spec_decode_stats()
        if spec is not None:
            stats["spec_decode"] = spec.to_dict()
        if self.executor.runner.engram is not None:
            stats["engram"] = self.executor.runner.engram.stats()
        return stats

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """The speculative-decoding counts of every sequence since start, finished (aborted included) and
        running: each counted once, and the totals only grow. None when ``args.speculative_config`` is None.
        O(running sequences · K)."""
        if self.args.speculative_config is None:
            return None
        total = SpecDecodeStats.empty(self.args.speculative_config.num_speculative_tokens)
        total.merge(self._spec_done)
        for s in self.seqs.values():
            if s.spec_decode is not None:
                total.merge(s.spec_decode)
        return total
