"""The side stream (python/v41/kernels/side_stream.py) on the GPU: work queued beside the main stream gives the
same logits, bit for bit, as the same work inline, in eager steps and in CUDA-graph replays, with programmatic
dependent launch on (pdl.WITH_SIDE_STREAM, the default); split-K counters are kept per stream lane. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

from v41.kernels import side_stream, wstream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_beside_joins_and_keeps_split_counters_per_lane(monkeypatch):
    monkeypatch.setattr(side_stream, "ENABLED", True)
    x = torch.randn(1, 4096, device="cuda")  # a one-token step: side_stream.MAX_TOKENS (8) takes it
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


# (side_stream.MAX_TOKENS, prompts): the default (8) through one prompt's batch-1 decode graph and through a 5-row
# decode (the prompts' prefills run inline); and every step on the side stream, prefill included
@pytest.mark.parametrize("max_tokens,n_prompts", [(8, 1), (8, 5), (1 << 20, 5)])
@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_side_stream_gives_the_inline_logits_bit_for_bit(tmp_path, arch, max_tokens, n_prompts, monkeypatch):
    from v41.testing.tiny import make_tiny

    from engine_helpers import assert_switch_keeps_logits

    monkeypatch.setattr(side_stream, "MAX_TOKENS", max_tokens)
    assert_switch_keeps_logits(make_tiny(tmp_path / arch, arch), side_stream, "ENABLED", monkeypatch,
                               n_prompts=n_prompts)
