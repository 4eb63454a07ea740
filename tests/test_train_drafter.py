"""The DSpark drafter trainer (issue 14): its teacher-forced draft equals the oracle's draft, and a few steps run
end to end, training only ``mtp.*``."""

from __future__ import annotations

import json

import numpy as np
import torch

from v41.models.reference import loader
from v41.testing.tiny import make_tiny
from v41.testing.train_drafter import draft_logits, sequence_loss, train_drafter

from test_train_tiny import _corpus


def test_the_teacher_forced_draft_equals_the_oracles_draft(tmp_path):
    """Three blocks in one batched call, each against the oracle's own draft after its prefix: the batched
    masks must hide the ring rows after each anchor and the other blocks' rows."""
    from v41.models.reference.dspark import write_context
    from v41.models.reference.state import RequestCache

    model = loader.load(make_tiny(tmp_path / "m", "deepseek_v41"))
    ids = torch.tensor([5, 9, 300, 17, 17, 42, 8, 99, 1000, 3, 64, 7, 12, 500, 6, 77, 31, 2, 400, 9])
    k = model.cfg.dspark_block_size
    _, aux = model.forward_chunk(ids, model.new_cache(), return_aux=True)
    ring = RequestCache()
    write_context(model.mtp, aux, torch.arange(ids.shape[0]), ring)
    tokens, pos, want = [], [], []
    for p in (3, 9, 13):  # verified prefix ids[: p + 1]; the anchor is ids[p + 1]
        cache = model.new_cache()
        model.forward_chunk(ids[: p + 1], cache)
        block = model.draft(cache, anchor=int(ids[p + 1]))
        tokens.append(torch.cat([ids[p + 1: p + 2], block.tokens[: k - 1]]))  # out_0 = anchor, then its drafts
        pos.append(block.positions)
        want.append(block)
    logits, conf = draft_logits(model, ring.dspark_kv, torch.stack(tokens), torch.stack(pos))
    for a, block in enumerate(want):
        torch.testing.assert_close(logits[a], block.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(conf[a], block.confidence, rtol=1e-4, atol=1e-4)


def test_the_drafter_loss_reaches_only_the_drafter(tmp_path):
    model = loader.load(make_tiny(tmp_path / "m", "deepseek_v41"))
    for name, p in model.named_parameters():
        p.requires_grad_(p.is_floating_point())
    ids = torch.randint(3, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    loss, stats = sequence_loss(model, ids, np.array([10, 20, 30]))
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert stats["blocks"] == 3 and len(stats["accepted"]) == model.cfg.dspark_block_size
    assert {"mtp.0.main_proj.weight", "mtp.2.markov_head.head.weight", "mtp.2.confidence_head.proj.weight"} <= grads
    assert not any(n.startswith("layers.") for n in grads)  # the main model is frozen (no_grad forward)


def test_a_few_drafter_steps_train_only_mtp_and_export(tmp_path):
    root, manifest = _corpus(tmp_path)
    main = make_tiny(tmp_path / "main", "deepseek_v41")
    record = train_drafter(main, tmp_path / "out", steps=3, minutes=5, seq_len=24, batch=2, anchors=3, lr=2e-3,
                           seed=0, corpus_root=root, manifest=manifest, threads=1, log=lambda *_: None)
    assert record["steps"] == 3 and json.loads((tmp_path / "out" / "drafter_log.json").read_text())["steps"] == 3
    before, after = loader.load(main).state_dict(), loader.load(tmp_path / "out").state_dict()
    moved = [n for n in after if not torch.equal(after[n], before[n])]
    assert moved and all(n.startswith("mtp.") for n in moved)


def test_self_distillation_trains_on_the_main_models_own_continuations(tmp_path):
    from v41.testing.train_drafter import continuations

    model = loader.load(make_tiny(tmp_path / "main", "deepseek_v41"))
    stream = np.arange(3, 60, dtype=np.int64)
    seqs = continuations(tmp_path / "main", stream, count=2, prompt_len=6, length=10, seed=0)
    assert [s.shape[0] for s in seqs] == [10, 10]
    assert continuations(tmp_path / "main", stream, count=2, prompt_len=6, length=10, seed=0)[1].tolist() == \
        seqs[1].tolist()  # the sampled one is seeded
    cache = model.new_cache()  # the even sequence is the greedy continuation of its prompt (the oracle's argmax,
    last = model.forward_chunk(seqs[0][:6], cache)[-1]  # up to near-ties, which a random model does not have)
    for t in seqs[0][6:].tolist():
        assert t == int(last.argmax())
        last = model.forward_chunk(torch.tensor([t]), cache)[-1]
    root, manifest = _corpus(tmp_path)
    record = train_drafter(tmp_path / "main", tmp_path / "out", steps=2, minutes=5, seq_len=16, batch=2, anchors=2,
                           lr=2e-3, seed=0, corpus_root=root, manifest=manifest, threads=1, self_distill=2,
                           prompt_len=8, log=lambda *_: None)
    assert record["steps"] == 2 and record["self_distill"] == 2


def test_acceptance_counts_follow_greedy_verification(tmp_path, monkeypatch):
    """A drafter that proposes the main model's own continuation is accepted everywhere, greedy and sampled
    (token-wise verification with q = p); the counters of the random drafter obey the verification rule."""
    import copy

    from v41.testing.acceptance import measure

    model = loader.load(make_tiny(tmp_path / "m", "deepseek_v41"))
    prompts = [torch.tensor([5, 9, 300, 17, 17, 42]), torch.tensor([8, 99, 1000, 3])]
    k = model.cfg.dspark_block_size
    got = measure(model, prompts, tokens=12, k=k)
    assert got["generated"] >= 12 and got["verified"] == [got["blocks"]] * k  # one pass verifies all K
    assert all(a >= b for a, b in zip(got["accepted"], got["accepted"][1:]))  # accepted drafts form a prefix
    oracle = model.draft

    def perfect(cache, anchor, temperature=0.0, generator=None):
        """Drafts from the main model itself: its argmax, or at a temperature its own samples with its own
        logits as the draft distribution (q = p: every draft is accepted)."""
        block = oracle(cache, anchor, temperature, generator)
        c, toks, logits, tok = copy.deepcopy(cache), [], [], anchor
        for _ in range(k):
            li = model.forward_chunk(torch.tensor([tok]), c)[-1]
            probs = torch.softmax(li.double() / max(temperature, 1e-9), -1)
            tok = int(li.argmax()) if temperature <= 0 else int(torch.multinomial(probs, 1, generator=generator))
            toks.append(tok)
            logits.append(li)
        block.tokens, block.logits = torch.tensor(toks), torch.stack(logits)
        return block

    sampled = measure(model, prompts, tokens=12, k=k, temperature=0.7, seed=3)
    assert sampled["generated"] >= 12 and sampled["pooled_acceptance"] < 1.0  # a random drafter is not q = p
    monkeypatch.setattr(model, "draft", perfect)
    best = measure(model, prompts, tokens=12, k=k)
    assert best["pooled_acceptance"] == 1.0 and best["mean_acceptance_length"] == k + 1
    best = measure(model, prompts, tokens=12, k=k, temperature=0.7, seed=3)
    assert best["pooled_acceptance"] == 1.0
