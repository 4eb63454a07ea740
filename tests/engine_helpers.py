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


def step_batch(cache, runs: list[tuple[int, list[int], int, list[int]]], max_blocks: int = 8,
               all_rows: bool = True):
    """A StepBatch without a scheduler: request slot s owns blocks s·max_blocks .. (s+1)·max_blocks − 1.

    runs: (slot, new token ids, first position, all earlier token ids). ``all_rows``: logits for every token
    row, else only for each run's last row."""
    from v41.engine.step import StepBatch, slots_for_tokens

    layout = cache.layout
    ids, pos, req, starts, hist = [], [], [], [], []
    for r, (slot, toks, p0, earlier) in enumerate(runs):
        starts.append((len(ids), len(toks), p0))
        ids += toks
        pos += list(range(p0, p0 + len(toks)))
        req += [r] * len(toks)
        hist.append(tuple(earlier[-3:]))
    ids_t, pos_t, req_t = (torch.tensor(v, dtype=torch.long) for v in (ids, pos, req))
    tables, slots = {}, {}
    for k in layout.kinds:
        bt = torch.stack([torch.arange(max_blocks) + s * max_blocks for s, *_ in runs])
        tables[k.name] = bt
        slots[k.name] = slots_for_tokens(bt, req_t, pos_t, layout.block_tokens, k.tokens_per_entry)
    rows = torch.arange(len(ids)) if all_rows else torch.tensor([a + n - 1 for a, n, _ in starts])
    return StepBatch(token_ids=ids_t, positions=pos_t, req_index=req_t, starts=tuple(starts), block_tables=tables,
                     slot_mapping=slots, state_rows=torch.tensor([s for s, *_ in runs]),
                     engram_history=tuple(hist), logits_rows=rows)
