"""DSpark speculative decoding in the engine core (docs/speculative-decoding.md §2): drafting after each step and
verification of the drafts the next step computed.

Per step, for a decoding request with k drafts the target computes ``[x0, d_1..d_k]`` at ``n..n+k`` (the
scheduler planned them; every computed token's drafter context rows are written inside the target forward).
:meth:`SpecDecoder.verify` turns the k + 1 rows of logits of every such request into the tokens to commit: the
accepted drafts ``d_1..d_a`` and one more token ``y`` (:class:`~.spec_verify.SpecVerifier`: greedy, token-wise
or block verification, keyed draws). Then :meth:`SpecDecoder.draft` runs one drafter pass for every request
that sampled, from its new anchor (the last committed token, at position ``n' = n + a + 1``), and draws the next
k drafts slot by slot through the Markov head, keeping each draft's law ``Q`` for the next verification; the
scheduler receives the drafts with the commit. With adaptive verification the whole block is drafted and each
request keeps the prefix :class:`~.adaptive_verify.AdaptivePlanner` gives it from the drafts' confidences.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .adaptive_verify import AdaptivePlanner, survivals
from .request import Sequence
from .sampler import Sampler, has_processor
from .spec_config import SpeculativeConfig
from .spec_verify import SpecVerifier, to_device


class SpecDecoder:
    """Drafting and verification under ``config`` (its K, draft sampling and verification methods).
    ``executor``: the engine's executor (its ``draft`` pass and its rank-0 drafter heads); ``sampler``: the
    engine's sampler (the processors of the target rows)."""

    def __init__(self, config: SpeculativeConfig, executor, sampler: Sampler):
        self.k = config.num_speculative_tokens
        self.method = config.rejection_sample_method
        self.greedy_drafts = config.draft_sample_method == "greedy"
        self.executor, self.verifier = executor, SpecVerifier(sampler)
        self.drafter = executor.runner.model.drafter
        runner = executor.runner
        self.planner = AdaptivePlanner(runner.verify_costs, self.k, runner.args.max_num_batched_tokens) \
            if config.enable_adaptive_verification else None

    def verify(self, seqs: list[Sequence], logits: Tensor, counts: list[int]) -> list[list[int]]:
        """Tokens to commit per sequence: the accepted drafts, then ``y``. ``logits`` [Σ (k_r + 1), V]: each
        sequence's verify rows ``[x0, d_1..d_{k_r}]`` in order (``counts`` = k_r ≥ 1, its drafts are
        ``seq.draft[:k_r]`` drawn from ``seq.draft_q[:k_r]``, None = one-hot at the draft). A batch of greedy
        requests verifies greedily whatever the method (the result is the same) and builds no ``Q``; without
        processors (bias, min_tokens, penalties: the rows are the raw logits) that is one argmax launch and the
        accept test on the host, from the one copy of the argmax ids the commit needs anyway."""
        k, b, vocab = max(counts), len(seqs), logits.shape[-1]
        states = [s.sampling for s in seqs]
        method = "greedy" if all(st.params.is_greedy for st in states) else self.method
        if method == "greedy" and not any(has_processor(st) for st in states):
            return _greedy_commits(seqs, logits.float().argmax(dim=-1).tolist(), counts)  # as penalized_logits
        drafts = to_device([s.draft[:c] + [0] * (k - c) for s, c in zip(seqs, counts)], logits.device)
        if method == "greedy":
            q = logits.new_zeros(1, 1, 1, dtype=torch.float32).expand(b, k, vocab)
        else:
            q = logits.new_zeros(b, k, vocab, dtype=torch.float32)
            for r, (seq, c) in enumerate(zip(seqs, counts)):
                if seq.draft_q is None:
                    q[r, :c].scatter_(1, drafts[r, :c, None], 1.0)
                else:
                    q[r, :c] = seq.draft_q[:c]
        target = self.verifier.target_probs(logits, states, drafts, counts)
        accepted, token = self.verifier.verify(method, target, drafts, q, counts, states)
        return [seq.draft[:a] + [y] for seq, a, y in zip(seqs, accepted.tolist(), token.tolist())]

    def draft(self, seqs: list[Sequence], table_rows: list[int]) -> list[list[int]]:
        """The next ``k`` drafts of each sequence (with adaptive verification a prefix of them, possibly empty),
        also kept in ``seq.draft`` with their laws in ``seq.draft_q`` ([k, V] float32, or None for one-hot laws).
        ``table_rows``: each sequence's block-table row. Drafts are sampled per the config (``probabilistic``:
        keyed draws from the processed drafter distribution, greedy requests by argmax; ``greedy``: the argmax).
        When every draft is an argmax the draft pass returns them (:func:`.draft_graph.draft_pass`, one graph
        replay); otherwise the Markov slots run here on its base logits."""
        if not seqs:
            return []
        keys = [s.sampling.seed for s in seqs]
        if self.planner is not None and not self.planner.should_draft(keys, [s.draft_survival for s in seqs]):
            for seq in seqs:  # a plain step: nothing to verify, no draft pass
                seq.draft, seq.draft_q = [], None
            return [[] for _ in seqs]
        anchors = np.array([s.output_token_ids[-1] for s in seqs], dtype=np.int64)
        positions = [s.sampling.position for s in seqs]
        base, hidden, greedy, greedy_conf = self.executor.draft(np.asarray(table_rows, dtype=np.int64), anchors,
                                           np.asarray(positions, dtype=np.int64))
        states = [s.sampling for s in seqs]
        if self.greedy_drafts or all(st.params.is_greedy for st in states):
            drafted, law, conf = greedy, None, greedy_conf
        else:
            out = torch.from_numpy(anchors).to(base.device)
            drafts, laws = [], []
            for i in range(self.k):
                out, q = self.verifier.draft(base[:, i] + self.drafter.markov_logits(out), states, positions, i)
                drafts.append(out)
                laws.append(q)
            drafted, law = torch.stack(drafts, dim=1), torch.stack(laws, dim=1)
            if self.planner is not None:
                outs = torch.cat([out.new_tensor(anchors)[:, None], drafted[:, :-1]], dim=1)
                conf = self.drafter.confidence(hidden[:, :self.k], outs)
        rows = drafted.tolist()
        if self.planner is not None:
            current = survivals(conf.cpu())
            fixed = [self.greedy_drafts or st.params.is_greedy for st in states]  # argmax drafts: no draw to bias
            keep = self.planner.plan(current, [c if f else s.draft_survival for c, f, s in zip(current, fixed, seqs)],
                                     keys)
            rows = [row[:c] for row, c in zip(rows, keep)]
            for seq, cur in zip(seqs, current):
                seq.draft_survival = cur
        for r, (seq, row) in enumerate(zip(seqs, rows)):
            seq.draft, seq.draft_q = row, (None if law is None else law[r, :len(row)])
        return rows


def _greedy_commits(seqs: list[Sequence], best: list[int], counts: list[int]) -> list[list[int]]:
    """Greedy verification from the argmax ids ``best`` of every verify row: ``a`` = the leading drafts equal to
    the argmax of their row, then ``y`` = the argmax of row ``a`` (docs/speculative-decoding.md §3a)."""
    out, first = [], 0
    for seq, c in zip(seqs, counts):
        row, a = best[first:first + c + 1], 0
        while a < c and seq.draft[a] == row[a]:
            a += 1
        out.append(seq.draft[:a] + [row[a]])
        first += c + 1
    return out
