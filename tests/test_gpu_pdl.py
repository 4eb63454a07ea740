"""Programmatic dependent launch (python/v41/kernels/pdl.py, cuda/common/pdl.cuh) on the GPU: a chain of kernels
that each read the previous one's output gives, with PDL, the results it gives without, bit for bit — eagerly and
in CUDA-graph replays with fresh inputs — and so do the engine's logits on tiny V4.1 and V4. Skipped without
CUDA (PDL itself needs sm_90)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import packed
from v41.kernels import dispatch, pdl, wstream
from v41.kernels.norm import rms_norm
from v41.kernels.rope import rope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a CUDA device of compute capability 9.0 or later")


def _chain(x, w1, w2, norm_w, cos, sin):
    """rms → W8A16 linear → rope → linear → rms: every kernel reads what the one before it wrote."""
    h = rms_norm(x, 1e-6, norm_w)
    a = wstream.linear(h, w1, torch.bfloat16)
    assert a is not None, "the CUDA weight-streaming kernel must take these shapes"
    a = rope(a.view(x.shape[0], -1, 64), cos, sin).view(x.shape[0], -1)
    b = wstream.linear(a, w2, torch.bfloat16)
    return rms_norm(b, 1e-6)


@pytest.mark.skipif(not dispatch.cuda_runs_on(torch.device("cuda")), reason="needs v41._cuda built (make cuda)")
def test_a_chain_of_dependent_launches_gives_the_serial_results(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.enabled(torch.device("cuda"))
    g = torch.Generator().manual_seed(3)
    w1 = packed(torch.randn(4096, 5120, generator=g) / 70, "fp8").to("cuda")  # 21 MB: long enough to race
    w2 = packed(torch.randn(5120, 4096, generator=g) / 60, "fp8").to("cuda")
    norm_w = torch.rand(5120, generator=g).to("cuda", torch.bfloat16) + 0.5
    ang = torch.rand(3, 32, generator=g).to("cuda")
    cos, sin = ang.cos(), ang.sin()

    def serial(x):
        monkeypatch.setattr(pdl, "ENABLED", False)
        try:
            return _chain(x, w1, w2, norm_w, cos, sin)
        finally:
            monkeypatch.setattr(pdl, "ENABLED", True)

    xs = [torch.randn(3, 5120, generator=g).to("cuda", torch.bfloat16) for _ in range(6)]
    for x in xs:  # eager, back to back
        assert torch.equal(_chain(x, w1, w2, norm_w, cos, sin), serial(x))
    static_x = xs[0].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _chain(static_x, w1, w2, norm_w, cos, sin)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = _chain(static_x, w1, w2, norm_w, cos, sin)
    for x in xs:
        static_x.copy_(x)
        graph.replay()
        graph.replay()  # twice: a replay follows a replay of the same kernels
        torch.cuda.synchronize()
        assert torch.equal(static_y, serial(x))


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_engine_logits_with_pdl_equal_those_without(tmp_path, arch, monkeypatch):
    from v41.testing.tiny import make_tiny

    from engine_helpers import assert_switch_keeps_logits

    assert_switch_keeps_logits(make_tiny(tmp_path / arch, arch), pdl, "ENABLED", monkeypatch, replays=4)
