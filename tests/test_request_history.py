"""``Sequence.history`` (the Engram lookback the engine hashes every step) equals the committed ids before a
position, across the prompt / output boundary."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from v41.engine.request import Sequence


@pytest.mark.parametrize("n_prompt,n_out", [(0, 5), (1, 0), (3, 4), (7, 1)])
@pytest.mark.parametrize("n", [0, 1, 3, 5])
def test_history_is_the_committed_ids_before_the_position(n_prompt, n_out, n):
    prompt, out = list(range(100, 100 + n_prompt)), list(range(200, 200 + n_out))
    seq = SimpleNamespace(prompt_token_ids=prompt, output_token_ids=out)
    committed = prompt + out
    for pos in range(len(committed) + 1):
        assert Sequence.history(seq, pos, n) == tuple(committed[max(0, pos - n):pos])
