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
    from v41.engine.args import EngineArgs
    from v41.engine.model_runner import ModelRunner
    from v41.models.engram_loader import engram_hasher
    from v41.testing.tiny import make_tiny

    from engine_helpers import host_step

    path = make_tiny(tmp_path / arch, arch)
    runners = {}
    for enabled in (False, True):  # graphs captured with and without PDL
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        args = EngineArgs(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=8,
                          max_cudagraph_capture_size=8)
        runner = ModelRunner(args, "cuda")
        runner.init_cache(num_blocks=8 * 8, num_state_rows=8, block_tokens=16, max_model_len=128)
        assert runner.graphs is not None
        runners[enabled] = runner

    def execute(step):
        outs = []
        for enabled, runner in runners.items():
            monkeypatch.setattr(pdl, "ENABLED", enabled)  # eager (prefill) steps read it at launch time
            outs.append(runner.execute(step).float())
        return outs

    layout = runners[True].cache_layout(16)
    hasher = engram_hasher(runners[True].cfg, path / "tokenizer.json")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (int(n),), generator=gen).tolist() for n in torch.randint(4, 30, (5,))]
    outs = execute(host_step(layout, [(s, p, 0, []) for s, p in enumerate(prompts)], 8, False, hasher))
    assert torch.equal(outs[0], outs[1])
    for _ in range(4):  # graph replays
        nxt = outs[0].argmax(-1).tolist()
        step = host_step(layout, [(s, [nxt[s]], len(p), p) for s, p in enumerate(prompts)], 8, False, hasher,
                         send_tables=False)
        assert runners[True].graphs.fits(step)
        for s, p in enumerate(prompts):
            p.append(nxt[s])
        outs = execute(step)
        assert torch.equal(outs[0], outs[1])
