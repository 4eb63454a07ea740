"""The MoE prefill tiles' MXFP4 → bf16 decode in PTX bit moves (``kernels/wtile.py`` mxfp4_tile_bits) on the GPU:
every (byte, scale byte) pair bit for bit against the spec's value rounded to bf16, and the prefill launch of
``moe.grouped_linear_triton`` (200 and 32 rows per expert) against its reference. tests/test_mxfp4_ptx.py checks
the same PTX text on the CPU."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import packed, poison
from v41.quant import dequant_mxfp4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from v41.kernels import moe, moe_align  # noqa: E402
from v41.kernels.packed import stack_experts  # noqa: E402
from v41.kernels.wtile import mxfp4_tile_bits  # noqa: E402


@triton.jit
def _decode_rows(w_ptr, s_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = rn < N
    for k0 in range(0, K, BK):
        w = mxfp4_tile_bits(w_ptr, s_ptr, rn, k0, nmask, K // 2, K // 32, K, BK)
        rk = k0 + tl.arange(0, BK)
        tl.store(out_ptr + rn[:, None] * K + rk[None, :], w, mask=nmask[:, None])


def test_every_byte_and_scale_decodes_to_the_spec_rounded_to_bf16():
    if not moe.bits_decode_runs(torch.bfloat16, torch.device("cuda")):
        pytest.skip("the bit moves run on sm_90 (moe.BITS_MAJORS)")
    n, k = 255, 512  # row r, block j: scale byte (r + 7j) % 255; bytes 0..255 along each row
    data = torch.arange(256, dtype=torch.uint8).repeat(n, 1)
    scale = ((torch.arange(n)[:, None] + 7 * torch.arange(k // 32)[None, :]) % 255).to(torch.uint8)
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
    _decode_rows[(triton.cdiv(n, 32),)](data.cuda(), scale.cuda(), out, n, k, BN=32, BK=64)
    want = dequant_mxfp4(data, scale).to(torch.bfloat16)
    got = out.cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got != want).nonzero()[:5]


@pytest.mark.parametrize("row_grid", [False, True])
@pytest.mark.parametrize("t", [400, 64])
def test_the_prefill_launch_equals_the_reference(t, row_grid, monkeypatch):
    """200 and 32 rows per expert (several row blocks each; one): grouped_config's prefill tiles (the bit moves on
    sm_90 from moe.PREFILL_MIN_ROWS rows per expert, else tl.dot_scaled), programs per expert or per row block
    (moe.PREFILL_ROW_GRID), rows gathered through token ids (w13) and in order (w2), output poisoned first."""
    monkeypatch.setattr(moe, "PREFILL_ROW_GRID", row_grid)
    g = torch.Generator().manual_seed(3)
    e, n, k, top = 4, 192, 512, 2
    w = stack_experts([packed(torch.randn(n, k, generator=g) / k ** 0.5, "mxfp4") for _ in range(e)]).to("cuda")
    ids = torch.randint(0, e, (t, top), generator=g).cuda()
    pairs = moe_align.route_pairs(ids, e)
    cfg = moe.grouped_config(t * top, w, torch.bfloat16)
    bits = moe.bits_decode_runs(torch.bfloat16, w.data.device)
    assert cfg["decode"] == ("bits" if bits else "scaled")
    assert (cfg["bm"], cfg["row_grid"]) == (moe.PREFILL_BM, row_grid) if bits else cfg["bm"] in (32, 128)
    x = torch.randn(t, k, generator=g).to("cuda", torch.bfloat16)
    for rows, xin in ((pairs.order // top, x), (None, torch.randn(t * top, k, generator=g).to("cuda", torch.bfloat16))):
        poison("cuda")
        y = moe.grouped_linear_triton(xin, w, pairs.offsets, rows, cfg, pairs.active)
        ref = moe.grouped_linear_ref(xin.double().cpu(), w.to("cpu"), pairs.offsets.cpu(),
                                     None if rows is None else rows.cpu())
        assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-2
