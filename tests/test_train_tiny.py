"""The tiny-model trainer (issue 14): the pinned corpus, the differentiable forward, and a few optimizer steps
end to end on a small corpus (seconds, so the script cannot rot)."""

from __future__ import annotations

import json

import pytest
import torch

from v41.models.reference import loader
from v41.testing.corpus import load_corpus, split, write_manifest
from v41.testing.train import sequence_logits, train, trainable
from v41.testing.tiny import make_tiny

TEXT = ("def greet(name):\n    \"\"\"Return a friendly greeting for name.\"\"\"\n    return f'hello {name}'\n\n" * 6)


def _corpus(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "a.py").write_text(TEXT)
    (root / "pkg" / "b.py").write_text(TEXT.replace("greet", "wave"))
    (root / "c.py").write_text(TEXT.replace("hello", "goodbye"))
    manifest = tmp_path / "manifest.json"
    write_manifest(["a.py", "pkg/b.py", "c.py"], ["c.py"], root, manifest)
    return root, manifest


def test_the_corpus_is_pinned_and_split_by_the_manifest(tmp_path):
    root, manifest = _corpus(tmp_path)
    train_docs, held = split(load_corpus(root, manifest), manifest)
    assert [d.name for d in train_docs] == ["a.py", "pkg/b.py"] and [d.name for d in held] == ["c.py"]
    (root / "pkg" / "b.py").write_text(TEXT + "# edited\n")
    (root / "c.py").unlink()
    with pytest.raises(ValueError, match=r"pkg/b\.py, c\.py \(missing\)"):
        load_corpus(root, manifest)


def test_the_shipped_manifest_names_existing_standard_library_modules():
    from v41.testing.corpus import manifest

    m = manifest()
    assert m["python"] == "3.11" and len(m["files"]) >= 30
    assert set(m["heldout"]) <= set(m["files"]) and len(m["heldout"]) < len(m["files"])


def test_the_training_forward_is_the_oracles_forward_with_gradients(tmp_path):
    model = loader.load(make_tiny(tmp_path / "m", "deepseek_v41"))
    params = trainable(model)
    ids = torch.tensor([5, 9, 300, 17, 17, 42, 8, 99, 1000, 3, 64, 7])
    want = model.forward_chunk(ids, model.new_cache())
    logits = sequence_logits(model, ids)
    torch.testing.assert_close(logits.detach(), want, rtol=0, atol=0)
    torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).backward()
    names = {id(p): n for n, p in model.named_parameters()}
    with_grad = {names[id(p)] for p in params if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert "embed.weight" in with_grad and "head.weight" in with_grad
    assert any(".attn.wq_b." in n for n in with_grad) and any(".ffn." in n for n in with_grad)
    assert not any(n.startswith("mtp.") for n in with_grad)
    assert all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)


def test_a_few_training_steps_lower_the_loss_and_export_a_loadable_checkpoint(tmp_path):
    root, manifest = _corpus(tmp_path)
    out = tmp_path / "trained"
    record = train(out, steps=6, minutes=5, seq_len=16, batch=2, lr=3e-3, seed=0, eval_every=3, eval_windows=2,
                   corpus_root=root, manifest=manifest, threads=1, log=lambda *_: None)
    assert record["steps"] == 6 and json.loads((out / "train_log.json").read_text())["steps"] == 6
    assert record["heldout_loss"] < record["heldout_loss_init"]
    # quantization-aware: the forward trained on what the checkpoint stores, so the export loses nothing
    assert record["heldout_loss_quantized"] == pytest.approx(record["heldout_loss"], rel=1e-6)
    trained, init = loader.load(out), loader.load(out / "init")
    moved = [n for n, p in trained.state_dict().items() if not torch.equal(p, init.state_dict()[n])]
    assert any(n.startswith("layers.") for n in moved) and not any(n.startswith("mtp.") for n in moved)
