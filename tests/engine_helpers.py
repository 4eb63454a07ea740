"""Shared helpers of the engine tests: reference greedy decoding with the margin rule and the bf16 bounds
(docs/numerics.md §4), step drivers, and the bf16 CUDA model's per-position logits (cuda_step_logits)."""

from __future__ import annotations

import numpy as np
import torch

MARGIN = 2e-4  # relative top-1 lead below which a greedy position is ambiguous (2 × the 1e-4 tolerance)
# The bf16 fast model against the float32 oracle (tests/test_fast_model.py) and two bf16 kernel paths against each
# other: max relative L2 of the logits per position (measured 2026-12-01: 0.034 V4.1, 0.018 V4). Greedy tokens are
# compared where the top-1 lead exceeds BF16_MARGIN of ‖logits‖: about 3× the largest elementwise bf16 error
# measured (0.0035·‖logits‖, V4.1), so a flip needs an error that was never seen.
BF16_BOUND, BF16_MARGIN = 0.06, 0.01


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


def whole_rows_diff(rows: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[3, R·W] int32 block-table diff that writes ``table`` [R, W] into persistent rows ``rows`` [R]."""
    r, w = table.shape
    return np.stack([np.repeat(rows, w), np.tile(np.arange(w), r), table.reshape(-1)]).astype(np.int32)


def host_step(layout, runs: list[tuple[int, list[int], int, list[int]]], max_blocks: int = 8, all_rows: bool = True,
              hasher=None, send_tables: bool = True):
    """A HostStep without a scheduler: request slot s owns blocks s·max_blocks .. (s+1)·max_blocks − 1 of every
    kind, row s of the persistent block tables and state row s.

    runs: (slot, new token ids, first position, all earlier token ids). ``all_rows``: logits for every token
    row, else only for each run's last row. ``hasher``: the Engram row hasher (models with Engram layers).
    ``send_tables``: the block-table diff writes the runs' whole rows (False: empty diff, for steps after the
    rows were sent — what the scheduler sends for decode steps inside a block)."""
    from v41.engine.host_step import HostStep

    ids, pos, counts = [], [], []
    for _, toks, p0, _ in runs:
        ids += toks
        pos += range(p0, p0 + len(toks))
        counts.append(len(toks))
    diffs, slots = {}, {}
    table_rows = np.array([s for s, *_ in runs], dtype=np.int32)
    for k in layout.kinds:
        bt = np.stack([np.arange(max_blocks) + s * max_blocks for s, *_ in runs]).astype(np.int32)
        r, rpb = k.tokens_per_entry, layout.block_tokens // k.tokens_per_entry
        sm = [int(bt[i, (p // r) // rpb]) * rpb + (p // r) % rpb if (p + 1) % r == 0 else -1
              for i, (_, toks, p0, _) in enumerate(runs) for p in range(p0, p0 + len(toks))]
        diff = whole_rows_diff(table_rows, bt) if send_tables else np.zeros((3, 0), dtype=np.int32)
        diffs[k.name], slots[k.name] = diff, np.array(sm, dtype=np.int32)
    engram = {}
    if hasher is not None:
        engram = {lid: np.concatenate([hasher.hash_ids(lid, toks, history=earlier[-3:]) for _, toks, _, earlier in runs])
                  for lid in hasher.layer_ids}
    ends = np.cumsum(counts)
    rows = np.arange(len(ids)) if all_rows else ends - 1
    return HostStep(token_ids=np.array(ids, dtype=np.int64), positions=np.array(pos, dtype=np.int64),
                    num_scheduled=np.array(counts, dtype=np.int64),
                    start_pos=np.array([p0 for _, _, p0, _ in runs], dtype=np.int64), table_rows=table_rows,
                    table_diffs=diffs, max_blocks={k: max_blocks for k in diffs}, slot_mapping=slots, state_rows=np.array([s for s, *_ in runs], dtype=np.int32),
                    logits_rows=rows.astype(np.int64), engram_rows=engram)


class StepDriver:
    """A step model (fast or paged) with its cache and input buffers, driven by :func:`host_step` runs.

    ``execute(runs, all_rows, return_aux)`` → what the model's forward returns."""

    def __init__(self, model, hasher, block_tokens: int, max_blocks: int = 32, n_slots: int = 4,
                 max_tokens: int = 256):
        from v41.engine.block_tables import DeviceBlockTables
        from v41.engine.input_buffers import InputBuffers

        self.model, self.hasher, self.max_blocks = model, hasher, max_blocks
        model.init_cache(num_blocks=n_slots * max_blocks, num_state_rows=n_slots, block_tokens=block_tokens)
        self.layout = model.cache_layout(block_tokens)
        cfg = model.cfg
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        tables = DeviceBlockTables({k.name: max_blocks for k in self.layout.kinds}, n_slots, "cpu")
        self.buffers = InputBuffers("cpu", max_tokens, n_slots, tables, model.segment_ratios, {lid: cols for lid in cfg.engram_layer_ids})

    def step(self, runs, all_rows: bool = True):
        return host_step(self.layout, runs, self.max_blocks, all_rows, self.hasher)

    def execute(self, runs, all_rows: bool = True, return_aux: bool = False):
        return self.model.forward(self.buffers.load(self.step(runs, all_rows)), return_aux)


def assert_switch_keeps_logits(path, module, attr: str, monkeypatch, replays: int = 3, n_prompts: int = 5) -> None:
    """CUDA GPU tests of a switch that must not change results (``module.attr``, e.g. the side stream or PDL): two
    model runners of the checkpoint at ``path``, their graphs captured with the switch off and on, give bit-equal
    logits for an eager prefill of ``n_prompts`` prompts and for ``replays`` decode steps of them replayed from the
    graphs (one prompt: the batch-1 graph)."""
    from v41.engine.args import EngineArgs
    from v41.engine.model_runner import ModelRunner
    from v41.models.engram_loader import engram_hasher

    runners = {}
    for enabled in (False, True):
        monkeypatch.setattr(module, attr, enabled)
        args = EngineArgs(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=8,
                          max_cudagraph_capture_size=8)
        runner = ModelRunner(args, "cuda")
        runner.init_cache(num_blocks=8 * 8, num_state_rows=8, block_tokens=16, max_model_len=128)
        assert runner.graphs is not None
        runners[enabled] = runner

    def execute(step):
        outs = []
        for enabled, runner in runners.items():
            monkeypatch.setattr(module, attr, enabled)  # eager (prefill) steps read it at launch time
            outs.append(runner.execute(step).float())
        return outs

    layout = runners[True].cache_layout(16)
    hasher = engram_hasher(runners[True].cfg, path / "tokenizer.json")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (int(n),), generator=gen).tolist() for n in torch.randint(4, 30, (n_prompts,))]
    outs = execute(host_step(layout, [(s, p, 0, []) for s, p in enumerate(prompts)], 8, False, hasher))
    assert torch.equal(outs[0], outs[1])
    for _ in range(replays):
        nxt = outs[0].argmax(-1).tolist()
        step = host_step(layout, [(s, [nxt[s]], len(p), p) for s, p in enumerate(prompts)], 8, False, hasher,
                         send_tables=False)
        assert runners[True].graphs.fits(step)
        for s, p in enumerate(prompts):
            p.append(nxt[s])
        outs = execute(step)
        assert torch.equal(outs[0], outs[1])


def cuda_step_logits(path, kv: str, ids: list[int], monkeypatch, mode: str, prefill: int = 20) -> torch.Tensor:
    """Logits of every position of ``ids`` from the bf16 fast model on CUDA in kernel mode ``mode``: a prefill of
    ``prefill`` tokens, then one decode step per token (teacher-forced)."""
    from v41.engine.args import EngineArgs
    from v41.engine.model_runner import ModelRunner
    from v41.models.engram_loader import engram_hasher

    monkeypatch.setenv("V41_KERNELS", mode)
    args = EngineArgs(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=4, enforce_eager=True,
                      kv_cache_dtype=kv)
    runner = ModelRunner(args, "cuda")
    runner.init_cache(num_blocks=4 * 8, num_state_rows=4, block_tokens=16, max_model_len=128)
    layout, hasher = runner.cache_layout(16), engram_hasher(runner.cfg, path / "tokenizer.json")
    out, a = [], 0
    while a < len(ids):
        b = prefill if a == 0 else a + 1
        out.append(runner.execute(host_step(layout, [(0, ids[a:b], a, ids[:a])], 8, True, hasher)).float().cpu())
        a = b
    return torch.cat(out)
