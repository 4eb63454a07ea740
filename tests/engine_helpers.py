"""Shared helpers of the engine tests: reference greedy decoding with the margin rule (DESIGN.md §4)."""

from __future__ import annotations

import torch

MARGIN = 2e-4  # relative top-1 lead below which a greedy position is ambiguous (2 × the 1e-4 tolerance)


def reference_greedy(model, prompt: list[int], max_tokens: int, eos: tuple[int, ...] = ()) -> tuple[list[int], int]:
    """Greedy tokens of the reference model and the index of the first ambiguous position (len if none)."""
    cache = model.new_cache()
    logits = model.forward_chunk(torch.tensor(prompt), cache)[-1]
    out, first_tie = [], max_tokens
    for i in range(max_tokens):
        top2 = logits.topk(2).values
        if first_tie == max_tokens and (top2[0] - top2[1]) / logits.norm() < MARGIN:
            first_tie = i
        tok = int(logits.argmax())
        out.append(tok)
        if tok in eos:
            break
        logits = model.forward_chunk(torch.tensor([tok]), cache)[-1]
    return out, min(first_tie, len(out))


def assert_same_tokens(got: list[int], want: list[int], first_tie: int) -> None:
    """Tokens must agree up to the first ambiguous position (reported when it cuts the comparison)."""
    n = min(first_tie, len(want))
    if n < len(want):
        print(f"margin rule: compared {n} of {len(want)} tokens")
    assert got[:n] == want[:n], (got, want, first_tie)
