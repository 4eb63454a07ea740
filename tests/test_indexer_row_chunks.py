"""The indexer's bounded scratch (``models/fast/attention.py`` INDEX_SCRATCH_BYTES): scoring and ranking a step's
queries in row chunks gives the same selections, hence bit-identical logits, as one pass, for V4.1 (candidate
source and filtered layers) and V4, in prefill and decode."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import StepDriver
from v41.models.engram_loader import engram_hasher
from v41.models.fast import attention, load_fast
from v41.testing.tiny import make_tiny


def test_row_chunks_cover_the_rows_within_the_budget(monkeypatch):
    monkeypatch.setattr(attention, "INDEX_SCRATCH_BYTES", 10 * 4 * attention.INDEX_BYTES_PER_ENTRY)
    assert attention.index_row_chunks(25, 4) == [slice(0, 10), slice(10, 20), slice(20, 25)]
    assert attention.index_row_chunks(0, 4) == [slice(0, 0)]
    assert attention.index_row_chunks(3, 1 << 40) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # at least a row
    monkeypatch.setattr(attention, "INDEX_SCRATCH_BYTES", 1 << 30)
    assert attention.index_row_chunks(2048, 1 << 20) == [slice(a, a + 32) for a in range(0, 2048, 32)]


def _logits(path, ids):
    model = load_fast(path, torch.float32, "cpu")
    drv = StepDriver(model, engram_hasher(model.cfg, path / "tokenizer.json"), 16)
    out = [drv.execute([(0, ids[:30], 0, [])])]
    for a in range(30, len(ids)):  # decode steps
        out.append(drv.execute([(0, ids[a:a + 1], a, ids[:a])]))
    return torch.cat(out)


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_row_chunked_selection_gives_the_one_pass_logits(tmp_path, arch, monkeypatch):
    path = make_tiny(tmp_path / arch, arch)
    ids = torch.randint(3, 1000, (36,), generator=torch.Generator().manual_seed(7)).tolist()
    whole = _logits(path, ids)
    calls = []
    chunks = attention.index_row_chunks
    monkeypatch.setattr(attention, "INDEX_SCRATCH_BYTES", 1)  # one query row per chunk
    for mod in ("attention_v41", "attention_v4"):
        monkeypatch.setattr(f"v41.models.fast.{mod}.index_row_chunks",
                            lambda t, n: calls.append(len(r := chunks(t, n))) or r)
    assert torch.equal(_logits(path, ids), whole)
    assert max(calls) == 30  # the prefill step was split into 30 one-row chunks
