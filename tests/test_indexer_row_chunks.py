"""The indexer's bounded scratch (``EngineArgs.index_scratch_bytes``, ``models/fast/attention.py``
``index_row_chunks``): scoring and ranking a step's queries in row chunks gives the same selections, hence
bit-identical logits, as one pass, for V4.1 (candidate source and filtered layers) and V4, in prefill and
decode."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import StepDriver
from v41.models.engram_loader import engram_hasher
from v41.models.fast import attention, load_fast
from v41.testing.tiny import make_tiny


def test_row_chunks_cover_the_rows_within_the_budget():
    per_row = 4 * attention.INDEX_BYTES_PER_ENTRY
    assert attention.index_row_chunks(25, 4, 10 * per_row) == [slice(0, 10), slice(10, 20), slice(20, 25)]
    assert attention.index_row_chunks(0, 4, 10 * per_row) == [slice(0, 0)]
    assert attention.index_row_chunks(3, 1 << 40, 1 << 30) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # ≥ a row
    assert attention.index_row_chunks(2048, 1 << 20, 1 << 30) == [slice(a, a + 32) for a in range(0, 2048, 32)]


def _logits(path, ids, scratch_bytes=None):
    model = load_fast(path, torch.float32, "cpu")
    if scratch_bytes is not None:
        model.index_scratch_bytes = scratch_bytes
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
    for mod in ("attention_v41", "attention_v4"):
        monkeypatch.setattr(f"v41.models.fast.{mod}.index_row_chunks",
                            lambda t, n, b: calls.append(len(r := chunks(t, n, b))) or r)
    assert torch.equal(_logits(path, ids, scratch_bytes=1), whole)  # one query row per chunk
    assert max(calls) == 30  # the prefill step was split into 30 one-row chunks
