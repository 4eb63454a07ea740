"""The Engram gate (docs/model.md §3.3): the projected table rows gated into every residual copy,

    s_c = Σ_d H_c·(q_c·k_c)·K_c / (rms(H_c)·rms(K_c)·sqrt(D)),   g_c = sigmoid(sign(s_c)·sqrt(max(|s_c|, floor))),
    out_c = H_c + g_c·V,

with ``rms(x) = sqrt(mean(x²) + eps)``, for each copy c of ``hc``, in float32 (float64 stays float64), returned in
H's dtype. ``kv`` [T, (hc+1)·D] holds the keys K_c (columns c·D .. (c+1)·D) and the value V (the last D columns).
The Triton kernel does it in one launch (one program per token and copy: a pass for the three sums, a pass for
the output) instead of ~20 elementwise and reduction kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import TRITON_DTYPES, triton, use_triton
from .pdl import triton_kw


def engram_gate_ref(h: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, floor: float) -> Tensor:
    """h [T, hc, D]; kv [T, (hc+1)·D]; q_weight, k_weight [hc, D] → [T, hc, D] in h's dtype."""
    t, hc, d = h.shape
    ct = torch.promote_types(h.dtype, torch.float32)
    key = kv[:, : hc * d].view(t, hc, d).to(ct)
    value = kv[:, hc * d:].to(ct)
    w = q_weight.to(ct) * k_weight.to(ct)
    hf = h.to(ct)
    rms_h = torch.sqrt(hf.pow(2).mean(-1) + eps)
    rms_k = torch.sqrt(key.pow(2).mean(-1) + eps)
    s = (hf * w * key).sum(-1) / (rms_h * rms_k * d ** 0.5)
    g = torch.sigmoid(torch.sign(s) * torch.sqrt(s.abs().clamp(min=floor)))
    return (hf + g.unsqueeze(-1) * value.unsqueeze(1)).to(h.dtype)


def engram_gate(h: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, floor: float) -> Tensor:
    """:func:`engram_gate_ref` as one Triton launch where :func:`.dispatch.use_triton` says so."""
    t, hc, d = h.shape
    if (h.dtype not in TRITON_DTYPES or kv.dtype not in TRITON_DTYPES or h.numel() == 0 or kv.stride(-1) != 1
            or kv.shape != (t, (hc + 1) * d) or q_weight.shape != (hc, d) or k_weight.shape != (hc, d)
            or not use_triton(h, kv, q_weight, k_weight)):
        return engram_gate_ref(h, kv, q_weight, k_weight, eps, floor)
    hc_ = h.contiguous()
    out = torch.empty_like(hc_)
    _gate_kernel[(t, hc)](hc_, kv, q_weight.contiguous(), k_weight.contiguous(), out, hc, d, kv.stride(0),
                          float(eps), float(floor), float(d ** 0.5), BD=min(1024, triton.next_power_of_2(d)),
                          **triton_kw(h.device))
    return out


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _gate_kernel(h_ptr, kv_ptr, qw_ptr, kw_ptr, out_ptr, HC, D, stride_kv, eps, floor, sqrt_d,
                     BD: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        t, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        h_row = h_ptr + (t * HC + c) * D
        k_row = kv_ptr + t * stride_kv + c * D
        v_row = kv_ptr + t * stride_kv + HC * D
        hh = tl.zeros([BD], dtype=tl.float32)
        kk = tl.zeros([BD], dtype=tl.float32)
        hk = tl.zeros([BD], dtype=tl.float32)
        for d0 in range(0, D, BD):
            rd = d0 + tl.arange(0, BD)
            m = rd < D
            hv = tl.load(h_row + rd, mask=m, other=0.0).to(tl.float32)
            kv = tl.load(k_row + rd, mask=m, other=0.0).to(tl.float32)
            w = tl.load(qw_ptr + c * D + rd, mask=m, other=0.0).to(tl.float32) * \
                tl.load(kw_ptr + c * D + rd, mask=m, other=0.0).to(tl.float32)
            hh += hv * hv
            kk += kv * kv
            hk += hv * w * kv
        rms_h = tl.sqrt(tl.sum(hh, axis=0) / D + eps)
        rms_k = tl.sqrt(tl.sum(kk, axis=0) / D + eps)
        s = tl.sum(hk, axis=0) / (rms_h * rms_k * sqrt_d)
        sign = tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, 0.0))
        g = tl.sigmoid(sign * tl.sqrt(tl.maximum(tl.abs(s), floor)))
        g = tl.where(s != s, s, g)  # a NaN score stays NaN, as in the reference (sign(NaN) = NaN)
        for d0 in range(0, D, BD):
            rd = d0 + tl.arange(0, BD)
            m = rd < D
            hv = tl.load(h_row + rd, mask=m, other=0.0).to(tl.float32)
            v = tl.load(v_row + rd, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + (t * HC + c) * D + rd, (hv + g * v).to(out_ptr.dtype.element_ty), mask=m)
