"""The MoE prefill path (python/v41/kernels/moe_prefill.py) on the CPU: dequantize-then-grouped-GEMM over chunks of
experts equals the reference for any chunk size (empty experts, a part-filled last chunk, gathered and pre-sorted
rows); the dispatch never takes it off CUDA or while it is switched off. Its Triton dequantization is checked in
``kernel_checks.check_moe_prefill`` (interpreter here, GPU in test_gpu_fast.py); the CUDA pipeline in the last
test here (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import packed
from v41.kernels import moe, moe_align, moe_prefill
from v41.kernels.packed import stack_experts

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this PyTorch has no torch._grouped_mm")


def _case(seed: int, e: int = 7, n: int = 48, k: int = 128, t: int = 30, top: int = 3):
    g = torch.Generator().manual_seed(seed)
    w = stack_experts([packed(torch.randn(n, k, generator=g) / k ** 0.5, "mxfp4") for _ in range(e)])
    ids = torch.randint(0, e - 2, (t, top), generator=g)  # the last two experts stay empty
    ids[:, 0] = 1  # expert 1 takes a pair of every token
    pairs = moe_align.route_pairs_ref(ids, e)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16)
    return w, pairs, x, top


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_dequant_mm_equals_the_reference(chunk):
    w, pairs, x, top = _case(chunk)
    for rows in (pairs.order // top, None):
        xin = x if rows is not None else torch.randn(x.shape[0] * top, x.shape[1]).to(torch.bfloat16)
        y = moe_prefill.grouped_dequant_mm(xin, w, pairs.offsets, rows, chunk=chunk)
        ref = moe.grouped_linear_ref(xin.double(), w, pairs.offsets, rows)
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        assert float((y.double() - ref).norm() / ref.norm()) < 1e-2, (chunk, rows is None)


def test_offsets_that_do_not_match_the_rows_are_an_error():
    w, pairs, x, top = _case(0)
    with pytest.raises(ValueError, match="offsets"):
        moe_prefill.grouped_dequant_mm(x, w, pairs.offsets, None)  # t rows, t·top pairs


def test_a_k_step_other_than_64_or_128_is_refused():
    """bk = 32 would leave MXFP4 tiles unscaled in the nibble decode (wtile.w_tile scales only SK < BK)."""
    w, pairs, x, top = _case(2)
    for bk in (32, 96, 256):
        cfg = dict(moe.grouped_config(x.shape[0] * top, w, x.dtype), bk=bk)
        with pytest.raises(ValueError, match="K step"):
            moe.grouped_linear_triton(x, w, pairs.offsets, pairs.order // top, cfg)


def test_the_dispatch_takes_it_only_on_cuda_and_when_switched_on(monkeypatch):
    w, pairs, x, top = _case(1)
    rows = pairs.order // top
    assert moe_prefill.grouped(x, w, pairs.offsets, rows) is None  # off (MIN_ROWS_PER_EXPERT = 0)
    monkeypatch.setattr(moe_prefill, "MIN_ROWS_PER_EXPERT", 1)
    assert not moe_prefill.available(x, w)  # CPU tensors
    assert moe_prefill.grouped(x, w, pairs.offsets, rows) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pipelined_on_cuda_through_the_dispatch(monkeypatch):
    """moe.grouped_linear takes the path when switched on: chunks of 5 of 24 experts on two streams (each scratch
    buffer reused several times), poisoned memory, twice in a row, against the reference."""
    from kernel_checks import poison

    monkeypatch.setattr(moe_prefill, "MIN_ROWS_PER_EXPERT", 1)
    monkeypatch.setattr(moe_prefill, "CHUNK", 5)
    calls = []
    real = moe_prefill.grouped_dequant_mm
    monkeypatch.setattr(moe_prefill, "grouped_dequant_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w, pairs, x, top = _case(2, e=24, n=256, k=512, t=300, top=6)
    w, x = w.to("cuda"), x.to("cuda")
    rows, offsets = (pairs.order // top).to("cuda"), pairs.offsets.to("cuda")
    ref = moe.grouped_linear_ref(x.double().cpu(), w.to("cpu"), pairs.offsets, pairs.order // top)
    for _ in range(2):
        poison("cuda")
        y = moe.grouped_linear(x, w, offsets, rows)
        assert float((y.double().cpu() - ref).norm() / ref.norm()) < 4e-3
    assert len(calls) == 2


@pytest.mark.parametrize("fmt,block", [("mxfp4", (1, 32)), ("fp8", (32, 32)), ("fp8", (128, 128))])
def test_a_large_stack_dequantizes_in_runs_of_experts_to_the_same_bits(fmt, block, monkeypatch):
    """PackedWeight.dequantize bounds its temporaries by dequantizing a stack in runs of experts
    (DEQUANT_CHUNK_ELEMENTS); the result is the whole stack's, bit for bit, and each expert's own."""
    from v41.kernels import packed as packed_mod

    g = torch.Generator().manual_seed(5)
    w = stack_experts([packed(torch.randn(48, 256, generator=g), fmt, block) for _ in range(7)])
    whole = w.dequantize(torch.bfloat16)
    monkeypatch.setattr(packed_mod, "DEQUANT_CHUNK_ELEMENTS", 2 * 48 * 256)  # runs of 2, 2, 2, 1 experts
    runs = w.dequantize(torch.bfloat16)
    assert runs.shape == (7, 48, 256) and torch.equal(runs, whole)
    one = packed_mod.PackedWeight(w.data[6], w.scale[6], w.fmt, w.block).dequantize(torch.bfloat16)
    assert torch.equal(runs[6], one)


def test_prefill_tiles_take_the_bit_moves_only_where_they_run(monkeypatch):
    """grouped_config: steps of MXFP4 experts on a GPU with at least PREFILL_MIN_ROWS pairs per expert take the PTX
    bit moves in PREFILL_BM-row blocks at PREFILL_BK / PREFILL_MAXNREG where moe.bits_decode_runs (bf16 on sm_90);
    elsewhere more than 64 pairs per expert take tl.dot_scaled at a K step of 128 in 128-row blocks without a
    register cap, and fewer the decode tiles; decode-sized steps never take the bit moves; an unknown decode is
    refused; the operand swap (PREFILL_SWAP) reaches the prefill tiles, never with tl.dot_scaled or FP8 weights."""
    from types import SimpleNamespace

    fake = SimpleNamespace(shape=(384, 4608, 5120), fmt="mxfp4",
                           data=SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0)))
    runs = {}
    monkeypatch.setattr(moe, "bits_decode_runs", lambda dtype, device: runs.setdefault("ok", dtype == torch.bfloat16))
    keys = ("decode", "bm", "bk", "maxnreg", "warps", "row_grid")
    bits = ("bits", moe.PREFILL_BM, moe.PREFILL_BK, moe.PREFILL_MAXNREG, moe.PREFILL_WARPS, moe.PREFILL_ROW_GRID)
    for tokens in (8192, 2048):  # 128 and 32 pairs per expert
        cfg = moe.grouped_config(tokens * 6, fake, torch.bfloat16)
        assert tuple(cfg[k] for k in keys) == bits
    assert moe.grouped_config(1024 * 6, fake, torch.bfloat16)["decode"] == "scaled"  # 16 pairs per expert
    monkeypatch.setattr(moe, "PREFILL_DECODE", "scaled")  # the A/B knob: the same tiles through tl.dot_scaled
    assert tuple(moe.grouped_config(2048 * 6, fake, torch.bfloat16)[k] for k in keys) == ("scaled", *bits[1:])
    runs["ok"] = False  # fp16, or a GPU other than sm_90: the knob changes nothing there
    for decode in ("scaled", "bits"):
        monkeypatch.setattr(moe, "PREFILL_DECODE", decode)
        cfg = moe.grouped_config(8192 * 6, fake, torch.float16)
        assert (cfg["decode"], cfg["bm"], cfg["bk"], cfg["maxnreg"], cfg["warps"]) == ("scaled", 128, 128, None, 8)
        cfg = moe.grouped_config(2048 * 6, fake, torch.float16)
        assert (cfg["decode"], cfg["bm"], cfg["bk"]) == ("scaled", 32, 128)
    assert moe.grouped_config(64 * 6, fake, torch.bfloat16)["decode"] == "scaled"  # decode-sized: 1 pair per expert
    w, pairs, x, top = _case(2)
    cfg = dict(moe.grouped_config(x.shape[0] * top, w, x.dtype), decode="bit")
    with pytest.raises(ValueError, match="expected one of"):
        moe.grouped_linear_triton(x, w, pairs.offsets, pairs.order // top, cfg)
    cfg["decode"] = "bits"  # CPU tensors
    with pytest.raises(ValueError, match="does not take"):
        moe.grouped_linear_triton(x, w, pairs.offsets, pairs.order // top, cfg)
    monkeypatch.setattr(moe, "PREFILL_SWAP", True)  # the operand swap: bit moves and nibbles only, MXFP4 only
    runs["ok"] = True
    assert moe.grouped_config(2048 * 6, fake, torch.bfloat16)["swap"]
    monkeypatch.setattr(moe, "PREFILL_DECODE", "scaled")
    assert not moe.grouped_config(2048 * 6, fake, torch.bfloat16)["swap"]
    cfg = dict(moe.grouped_config(x.shape[0] * top, w, x.dtype), decode="scaled", swap=True)
    with pytest.raises(ValueError, match="swap takes"):
        moe.grouped_linear_triton(x, w, pairs.offsets, pairs.order // top, cfg)
    w8 = stack_experts([packed(torch.randn(48, 128), "fp8") for _ in range(7)])
    cfg = dict(moe.grouped_config(x.shape[0] * top, w8, x.dtype), decode="nibble", swap=True)
    with pytest.raises(ValueError, match="swap takes"):
        moe.grouped_linear_triton(x, w8, pairs.offsets, pairs.order // top, cfg)


@pytest.mark.parametrize("counts,bm", [([40, 0, 17, 16, 1], 16), ([0, 0, 3], 16), ([130, 128, 0, 5], 128),
                                       ([3, 0, 0], 16), ([1, 1, 1], 16), ([0, 256, 0], 128)])
def test_row_blocks_tile_each_experts_rows_in_order(counts, bm):
    """moe_align.row_blocks: block b belongs to the expert whose ⌈count / bm⌉ blocks hold it, in expert order;
    ``first[e]`` is that expert's first block; blocks past the last are −1 (the launch's grid: ⌈P / bm⌉ + min(E, P),
    always enough)."""
    offsets = torch.tensor([0] + counts).cumsum(0)
    n_blocks = -(-sum(counts) // bm) + min(len(counts), sum(counts))
    owner, first = moe_align.row_blocks(offsets, bm, n_blocks)
    want, firsts = [], []
    for e, c in enumerate(counts):
        firsts.append(len(want))
        want += [e] * -(-c // bm)
    assert owner.tolist() == want + [-1] * (n_blocks - len(want))
    assert first.tolist() == firsts
