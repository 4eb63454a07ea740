"""The inline PTX that decodes MXFP4 into bf16 (``kernels/wtile.py`` MXFP4_BF16_PTX), run on the CPU by an
interpreter of the seven instructions it uses, against the spec's dequantization (``v41.quant.dequant_mxfp4``, then
rounded to bf16) for every byte and every scale byte 0..254. The GPU runs the same text inside the MoE kernel
(tests/kernel_checks.py ``check_grouped``, the ``bits`` decode)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from v41.quant import dequant_mxfp4

triton = pytest.importorskip("triton")
from v41.kernels.wtile import MXFP4_BF16_PTX  # noqa: E402  (Triton is optional)

M32 = 0xFFFFFFFF


def _halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x & 0xFFFF, x >> 16


def _bf16_to_f32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f: np.ndarray) -> np.ndarray:
    """Round to nearest even (torch's conversion), as bf16 bits."""
    return torch.from_numpy(f).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint32) & 0xFFFF


def _prmt(a, b, sel: int):
    """prmt.b32 default mode: result byte i = byte (sel nibble i & 7) of {b, a} (a = bytes 0-3, b = bytes 4-7)."""
    pool = (a.astype(np.uint64) | (b.astype(np.uint64) << 32))
    out = np.zeros_like(a)
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        assert n < 8, "sign-replicate mode is not used"
        out |= ((pool >> np.uint64(8 * n)) & np.uint64(0xFF)).astype(np.uint32) << (8 * i)
    return out


def _lop3(a, b, c, lut: int):
    out = np.zeros_like(a)
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1).astype(np.uint32) << bit
    return out


def _max_u16x2(a, b):
    (al, ah), (bl, bh) = _halves(a), _halves(b)
    return np.maximum(al, bl) | (np.maximum(ah, bh) << 16)


def _mul_bf16x2(a, b):
    """mul.rn.bf16x2: each half's product rounded to bf16 (the float32 products here are exact: codes times powers
    of two above 2^-149)."""
    (al, ah), (bl, bh) = _halves(a), _halves(b)
    with np.errstate(over="ignore", invalid="ignore"):
        lo = _f32_to_bf16(_bf16_to_f32(al) * _bf16_to_f32(bl))
        hi = _f32_to_bf16(_bf16_to_f32(ah) * _bf16_to_f32(bh))
    return lo | (hi << 16)


def run_ptx(text: str, args: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Executes ``text`` (one instruction a line) over uint32 arrays; ``args`` = {operand number: value}."""
    regs: dict[str, np.ndarray] = {f"${k}": v.astype(np.uint32) for k, v in args.items()}

    def val(tok: str):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full_like(next(iter(args.values())), int(tok, 0), dtype=np.uint32)

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith((".reg", "//")):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            out = val(src[0])
        elif op == "prmt.b32":
            out = _prmt(val(src[0]), val(src[1]), int(src[2], 0))
        elif op == "shl.b32":
            out = (val(src[0]).astype(np.uint64) << np.uint64(int(src[1]))).astype(np.uint64) & M32
        elif op == "and.b32":
            out = val(src[0]) & val(src[1])
        elif op == "lop3.b32":
            out = _lop3(val(src[0]), val(src[1]), val(src[2]), int(src[3], 0))
        elif op == "max.u16x2":
            out = _max_u16x2(val(src[0]), val(src[1]))
        elif op == "mul.rn.bf16x2":
            out = _mul_bf16x2(val(src[0]), val(src[1]))
        else:
            raise AssertionError(f"instruction {op} has no model here")
        regs[dst] = np.asarray(out).astype(np.uint32)
    return {int(k[1:]): v for k, v in regs.items() if re.fullmatch(r"\$[0-3]", k)}


def test_the_ptx_decode_is_the_spec_rounded_to_bf16_for_every_byte_and_scale():
    b = np.arange(256, dtype=np.uint32)
    byte, scale = (v.ravel() for v in np.meshgrid(b, np.arange(255, dtype=np.uint32), indexing="ij"))
    # one call packs four (byte, scale) pairs; lanes get different bytes and scales to catch crossed lanes
    n = byte.size // 4 * 4
    rng = np.random.default_rng(0)
    perm = rng.permutation(byte.size)[:n]
    q, s = byte[perm].reshape(-1, 4), scale[perm].reshape(-1, 4)
    pack = lambda v: v[:, 0] | (v[:, 1] << 8) | (v[:, 2] << 16) | (v[:, 3] << 24)  # noqa: E731
    out = run_ptx(MXFP4_BF16_PTX, {4: pack(q), 5: pack(s)})
    lo = np.stack([out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16], 1)  # low nibbles of b0..b3
    hi = np.stack([out[2] & 0xFFFF, out[2] >> 16, out[3] & 0xFFFF, out[3] >> 16], 1)
    codes = torch.from_numpy(q.astype(np.uint8).reshape(-1, 1))
    # the spec's value of each byte's two inputs at its scale (one scale block per byte: pad the block to 32 inputs)
    packed = torch.cat([codes, torch.zeros(codes.shape[0], 15, dtype=torch.uint8)], 1)
    want = dequant_mxfp4(packed, torch.from_numpy(s.astype(np.uint8).reshape(-1, 1)))[:, :2]
    want_bits = want.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint32) & 0xFFFF
    got = np.stack([lo.reshape(-1), hi.reshape(-1)], 1)
    assert np.array_equal(got, want_bits), np.argwhere(got != want_bits)[:5]


def test_the_default_prefill_tiling_compiles_for_sm90_with_several_ctas_per_sm():
    """moe.PREFILL_* (the bit moves, K step 64, 128-register cap) through Triton's compiler and ptxas for sm_90a, as
    benches/gpu/triton_regs.py counts them: at least two CTAs fit an SM's 65,536 registers, and at most a few stack
    slots spill (the timed default, 64-row blocks over 4 warps capped at 128 registers: 72 bytes, four CTAs per SM;
    a cap of 168 spills nothing at three, not timed: benches/RESULTS.md "2026-12-05 (night)")."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches" / "gpu"))
    from triton_regs import compile_grouped

    from v41.kernels import moe

    assert moe.PREFILL_DECODE == "bits"
    for gather in (True, False):
        r = compile_grouped(moe.PREFILL_BM, moe.PREFILL_BN, moe.PREFILL_BK, moe.PREFILL_STAGES, moe.PREFILL_MAXNREG,
                            moe.PREFILL_WARPS, moe.PREFILL_DECODE, gather, moe.PREFILL_SWAP)
        assert r["spills"] <= 128 and 65536 // (32 * moe.PREFILL_WARPS * r["registers"]) >= 2, r
        assert 0 < r["loop"] and 0 < r["sass"] < r["loop"] * 2 and r["shared"] <= 228 * 1024 // 2, r
