"""The side stream (python/v41/kernels/side_stream.py) on the GPU: work queued beside the main stream gives the
same logits, bit for bit, as the same work inline, in eager steps and in CUDA-graph replays; split-K counters are
kept per stream lane. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from v41.kernels import side_stream, wstream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_beside_joins_and_keeps_split_counters_per_lane(monkeypatch):
    monkeypatch.setattr(side_stream, "ENABLED", True)
    x = torch.randn(4096, device="cuda")
    main = wstream.split_counters(x.device)
    seen = {}

    def work():
        seen["lane"] = side_stream.lane()
        seen["stream"] = torch.cuda.current_stream()
        seen["counters"] = wstream.split_counters(x.device)
        return (x * 2).sum()

    pending = side_stream.beside(work, x, "shared_expert")
    assert side_stream.lane() == 0 and seen["lane"] == 1
    assert seen["stream"] != torch.cuda.current_stream()
    assert seen["counters"].data_ptr() != main.data_ptr()
    assert torch.equal(pending.wait(), (x * 2).sum())


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_side_stream_gives_the_inline_logits_bit_for_bit(tmp_path, arch, monkeypatch):
    from v41.engine.args import EngineArgs
    from v41.engine.model_runner import ModelRunner
    from v41.models.engram_loader import engram_hasher
    from v41.testing.tiny import make_tiny

    from engine_helpers import host_step

    path = make_tiny(tmp_path / arch, arch)
    runners = {}
    for enabled in (False, True):  # graphs captured with and without the side stream
        monkeypatch.setattr(side_stream, "ENABLED", enabled)
        args = EngineArgs(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=8,
                          max_cudagraph_capture_size=8)
        runner = ModelRunner(args, "cuda")
        runner.init_cache(num_blocks=8 * 8, num_state_rows=8, block_tokens=16, max_model_len=128)
        assert runner.graphs is not None
        runners[enabled] = runner

    def execute(step):
        outs = []
        for enabled, runner in runners.items():
            monkeypatch.setattr(side_stream, "ENABLED", enabled)  # eager (prefill) steps read it at run time
            outs.append(runner.execute(step).float())
        return outs

    layout = runners[True].cache_layout(16)
    hasher = engram_hasher(runners[True].cfg, path / "tokenizer.json")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (int(n),), generator=gen).tolist() for n in torch.randint(4, 30, (5,))]
    outs = execute(host_step(layout, [(s, p, 0, []) for s, p in enumerate(prompts)], 8, False, hasher))
    assert torch.equal(outs[0], outs[1])
    for _ in range(3):  # graph replays
        nxt = outs[0].argmax(-1).tolist()
        step = host_step(layout, [(s, [nxt[s]], len(p), p) for s, p in enumerate(prompts)], 8, False, hasher,
                         send_tables=False)
        assert runners[True].graphs.fits(step)
        for s, p in enumerate(prompts):
            p.append(nxt[s])
        outs = execute(step)
        assert torch.equal(outs[0], outs[1])
