"""The embedded model shipped in the package (issue 14; :mod:`v41.testing.embedded`): a checkpoint in the checkpoint
formats that both models load, that has learned its corpus (held-out loss under a pinned bound, far below uniform)
and whose DSpark drafter agrees with it (free-running greedy acceptance above a pinned bound). The bounds sit
below the figures benches/RESULTS.md reports for the shipped files (measured there on more text), so a
retrained or damaged model that loses what it learned fails here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from v41.checkpoint import iter_stored
from v41.config import load_config
from v41.models.fast import load_fast
from v41.models.reference import loader
from v41.testing.acceptance import heldout_prompts, measure
from v41.testing.corpus import load_corpus, split
from v41.testing.embedded import EMBEDDED_DIR, REQUIRED, embedded_model_dir
from v41.testing.train import heldout_loss, token_stream

HELDOUT_LOSS_BOUND = 4.0  # nats / token, 4 held-out windows of 128 tokens: shipped 3.46, uniform ln(1024) = 6.93
ACCEPTANCE_BOUND = 0.4  # pooled over the K = 5 drafts of every block, greedy, 3 held-out prompts: shipped 0.50


@pytest.fixture(scope="module")
def model():
    return loader.load(embedded_model_dir()).eval()


def test_the_shipped_files_are_a_checkpoint_in_the_checkpoint_formats():
    path = embedded_model_dir()
    cfg = load_config(path)
    assert cfg.is_v41 and cfg.has_dspark  # the drafter ships with it
    stored = dict(iter_stored(path))
    fp8 = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    experts = [n for n in stored if ".experts." in n and n.endswith(".weight")]
    assert fp8 and experts
    assert all(stored[n].dtype in (torch.uint8, torch.int8) for n in experts)  # MXFP4, two values a byte
    size = sum(f.stat().st_size for f in Path(path).iterdir())
    assert size <= 10 << 20
    load_fast(path, torch.float32, "cpu")  # the engine's model loads it too


def test_an_incomplete_install_is_a_clear_error(monkeypatch, tmp_path):
    import v41.testing.embedded as embedded

    for name in REQUIRED[:-1]:
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(embedded, "EMBEDDED_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
        embedded.embedded_model_dir()
    assert EMBEDDED_DIR.is_dir()


def test_the_embedded_model_has_learned_its_corpus(model):
    tokenizer = Tokenizer.from_file(str(embedded_model_dir() / "tokenizer.json"))
    _, held = split(load_corpus())
    stream = token_stream(tokenizer, held, model.cfg.eos_token_ids[0])
    loss = heldout_loss(model, stream, 128, 4)
    assert loss < HELDOUT_LOSS_BOUND < math.log(model.cfg.vocab_size)


def test_the_embedded_drafter_agrees_with_its_model(model):
    prompts = heldout_prompts(embedded_model_dir(), model.cfg.eos_token_ids[0], 48, 3)
    result = measure(model, prompts, tokens=90, k=model.cfg.dspark_block_size)
    assert result["generated"] >= 90
    assert result["pooled_acceptance"] >= ACCEPTANCE_BOUND, result
