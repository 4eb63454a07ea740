"""DSpark speculative decoding in the engine core (docs/speculative-decoding.md §2): drafting after each step and
verification of the drafts the next step computed.

Per step, for a decoding request with k drafts the target computes ``[x0, d_1..d_k]`` at ``n..n+k`` (the
scheduler planned them; every computed token's drafter context rows are written inside the target forward).
:meth:`SpecDecoder.verify` turns the k + 1 rows of logits of every such request into the tokens to commit: the
accepted drafts ``d_1..d_a`` and one more token ``y`` (:class:`~.spec_verify.SpecVerifier`: greedy, token-wise
or block verification, keyed draws). Then :meth:`SpecDecoder.draft` runs one drafter pass for every request
that sampled, from its new anchor (the last committed token, at position ``n' = n + a + 1``), and draws the next
k drafts slot by slot through the Markov head, keeping each draft's law ``Q`` for the next verification; the
scheduler receives the drafts with the commit.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .request import Sequence
from .sampler import Sampler
from .spec_config import SpeculativeConfig
from .spec_verify import SpecVerifier


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

    def verify(self, seqs: list[Sequence], logits: Tensor, counts: list[int]) -> list[list[int]]:
        """Tokens to commit per sequence: the accepted drafts, then ``y``. ``logits`` [Σ (k_r + 1), V]: each
        sequence's verify rows ``[x0, d_1..d_{k_r}]`` in order (``counts`` = k_r ≥ 1, its drafts are
        ``seq.draft[:k_r]`` drawn from ``seq.draft_q[:k_r]``)."""
        k = max(counts)
        drafts = torch.zeros(len(seqs), k, dtype=torch.int64)
        q = logits.new_zeros(len(seqs), k, logits.shape[-1], dtype=torch.float32)
        for r, (seq, c) in enumerate(zip(seqs, counts)):
            drafts[r, :c] = torch.tensor(seq.draft[:c])
            q[r, :c] = seq.draft_q[:c]
        drafts = drafts.to(logits.device)
        states = [s.sampling for s in seqs]
        target = self.verifier.target_probs(logits, states, drafts, counts)
        accepted, token = self.verifier.verify(self.method, target, drafts, q, counts, states)
        return [seq.draft[:a] + [y] for seq, a, y in zip(seqs, accepted.tolist(), token.tolist())]

    def draft(self, seqs: list[Sequence], table_rows: list[int]) -> list[list[int]]:
        """The next ``k`` drafts of each sequence, also kept in ``seq.draft`` with their laws in ``seq.draft_q``
        [k, V]. ``table_rows``: each sequence's block-table row. Drafts are sampled per the config
        (``probabilistic``: keyed draws from the processed drafter distribution; ``greedy``: its argmax)."""
        if not seqs:
            return []
        anchors = np.array([s.output_token_ids[-1] for s in seqs], dtype=np.int64)
        positions = [s.sampling.position for s in seqs]
        base = self.executor.draft(np.asarray(table_rows, dtype=np.int64), anchors,
                                      np.asarray(positions, dtype=np.int64))
        base = base.view(len(seqs), -1, base.shape[-1])
        out = torch.from_numpy(anchors).to(base.device)
        states = [s.sampling for s in seqs]
        drafts, laws = [], []
        for i in range(self.k):
            logits = base[:, i] + self.drafter.markov_logits(out)
            if self.greedy_drafts:
                out = logits.argmax(dim=-1)
                law = torch.nn.functional.one_hot(out, logits.shape[-1]).float()
            else:
                out, law = self.verifier.draft(logits, states, positions, i)
            drafts.append(out)
            laws.append(law)
        rows = torch.stack(drafts, dim=1).tolist()
        law = torch.stack(laws, dim=1)
        for r, (seq, row) in enumerate(zip(seqs, rows)):
            seq.draft, seq.draft_q = row, law[r]
        return rows
