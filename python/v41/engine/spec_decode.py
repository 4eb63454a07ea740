"""DSpark speculative decoding in the engine core (docs/speculative-decoding.md §2): drafting after each step and
verification of the drafts the next step computed.

Per step, for a decoding request with k drafts the target computes ``[x0, d_1..d_k]`` at ``n..n+k`` (the
scheduler planned them; every computed token's drafter context rows are written inside the target forward).
:meth:`SpecDecoder.verify` turns the k + 1 rows of logits into the tokens to commit: the accepted drafts
``d_1..d_a`` and one more token ``y`` (greedy verification: ``a`` = the first i whose draft differs from the
target's choice, ``y`` = the target's choice at row a). Then :meth:`SpecDecoder.draft` runs one drafter pass for
every request that sampled, from its new anchor (the last committed token, at position ``n' = n + a + 1``), and
draws the next k drafts slot by slot through the Markov head; the scheduler receives them with the commit.

Greedy rows only so far: sampled (temperature > 0) requests are refused by :meth:`SpecDecoder.check_params`
until token-wise / block verification land.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .request import Sequence
from .sampler import Sampler, SamplingState


class SpecDecoder:
    """Drafting and verification for ``k`` drafts per step. ``executor``: the engine's executor (its ``draft``
    pass and its rank-0 drafter heads); ``sampler``: the engine's sampler (processors of the target rows)."""

    def __init__(self, k: int, executor, sampler: Sampler):
        self.k, self.executor, self.sampler = k, executor, sampler
        self.drafter = executor.runner.model.drafter

    def check_params(self, params) -> None:
        """Raise ValueError for sampling parameters speculation does not serve yet."""
        if not params.is_greedy:
            raise ValueError("speculative decoding serves greedy requests (temperature 0) so far")

    def verify(self, seq: Sequence, logits: Tensor) -> list[int]:
        """Tokens to commit for ``seq`` from its k + 1 verify rows ``logits`` [k + 1, V] (row j scores the token
        after ``[x0, d_1..d_j]``): the accepted drafts, then the target's token. Greedy verification: row j's
        choice is the plain sampler's greedy choice (processors included) given the tokens before it."""
        drafts = seq.draft[: logits.shape[0] - 1]
        st = seq.sampling
        rows = [SamplingState(st.params, st.prompt_token_ids, st.seed, st.output_token_ids + drafts[:j])
                for j in range(len(drafts) + 1)]
        choice = self.sampler.penalized_logits(logits.float(), rows).argmax(dim=-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == choice[a]:
            a += 1
        return drafts[:a] + [choice[a]]

    def draft(self, seqs: list[Sequence], table_rows: list[int]) -> list[list[int]]:
        """The next ``k`` drafts of each sequence (greedy through the Markov head), also kept in ``seq.draft``.
        ``table_rows``: each sequence's block-table row."""
        if not seqs:
            return []
        anchors = np.array([s.output_token_ids[-1] for s in seqs], dtype=np.int64)
        positions = np.array([s.sampling.position for s in seqs], dtype=np.int64)
        base, _ = self.executor.draft(np.asarray(table_rows, dtype=np.int64), anchors, positions)
        base = base.view(len(seqs), -1, base.shape[-1])
        out = torch.from_numpy(anchors).to(base.device)
        drafts = []
        for i in range(self.k):
            out = (base[:, i] + self.drafter.markov_logits(out)).argmax(dim=-1)
            drafts.append(out)
        rows = torch.stack(drafts, dim=1).tolist()
        for seq, row in zip(seqs, rows):
            seq.draft = row
        return rows
