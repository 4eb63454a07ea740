"""Train the DSpark drafter stages (``mtp.*``) of a trained tiny V4.1 against its frozen main model (issue 14,
step 2; docs/model.md §3.9, docs/speculative-decoding.md).

    python -m v41.testing.train_drafter --main /tmp/trained --out /tmp/drafted [--minutes 30]

Training text: corpus windows, or (``--self-distill N``) N continuations the main model wrote itself from corpus
prompts, greedy and sampled (:func:`continuations`), anchored inside the generated part. Per training sequence
the main model runs once without gradients and gives its aux streams (the drafter's
context input) and its next-token distribution at every position. The drafter's context KV rings are then
computed with gradients (``main_proj``, ``main_norm`` and each stage's ``wkv`` / ``kv_norm`` learn), and for
``anchors`` random verified positions P one draft block is run teacher-forced (:func:`draft_logits`: the
Markov head reads the text's tokens instead of its own drafts). Losses, per block position i: the
cross-entropy of the drafter's Markov-corrected logits against the main model's distribution at P+1+i
(distillation), and the binary cross-entropy of the confidence logit against "the draft up to i is accepted
by greedy verification" (the drafter's argmax equals the main model's, at i and before). Only ``mtp.*``
trains (quantization-aware, as the main model); the main model's embedding and LM head are shared and frozen.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.nn.utils import parametrize

from ..models.reference import loader
from ..models.reference.attention import ChunkContext
from ..models.reference.dspark import write_context
from ..models.reference.model import Transformer
from ..models.reference.ops import hc_collapse
from ..models.reference.state import RequestCache
from .corpus import MANIFEST, load_corpus, split
from .train import bake, export, lr_at, quantization_aware, token_stream


def draft_logits(model: Transformer, cache: RequestCache, tokens: torch.Tensor, pos: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft block, teacher-forced and differentiable: :meth:`Transformer.draft` with ``out_i =
    tokens[i]`` in the Markov head (``tokens[0]`` is the anchor). tokens, pos: [K] (positions P+1..P+K; the
    rings of ``cache`` must hold positions ≤ P). Returns (Markov-corrected logits [K, V], confidence logits [K])."""
    cfg = model.cfg
    k = tokens.shape[0]
    ids = torch.cat([tokens[:1], torch.full((k - 1,), cfg.dspark_noise_token_id, dtype=tokens.dtype)])
    ctx = ChunkContext(pos=pos, token_ids=ids, cache=cache)
    h = model.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    pre_mix = torch.zeros(k, cfg.hc_mult, dtype=h.dtype)
    pre_mix[:, 0] = 1
    for stage in model.mtp:
        h, pre_mix = stage(h, pre_mix, ids, lambda x, a=stage.attn: a(x, ctx))
    last = model.mtp[-1]
    y = hc_collapse(h, pre_mix)
    e = last.markov_head.embed.weight[tokens]
    logits = model.head(last.norm(y)) + last.markov_head.head(e)
    return logits, last.confidence_head.proj(torch.cat([y, e], dim=-1))[:, 0]


def sequence_loss(model: Transformer, ids: torch.Tensor, anchors: np.ndarray) -> tuple[torch.Tensor, dict]:
    """Drafter loss of one sequence ``ids`` [T] at verified positions ``anchors`` (each P ≤ T − K − 2), and
    the greedy acceptance counts per block position (module docstring)."""
    k = model.cfg.dspark_block_size
    with torch.no_grad():
        target, aux = model.forward_chunk(ids, model.new_cache(), return_aux=True)
    teacher = torch.log_softmax(target.float(), dim=-1)
    cache = RequestCache()
    write_context(model.mtp, aux, torch.arange(ids.shape[0]), cache)
    loss = torch.zeros(())
    accepted = np.zeros(k, dtype=np.int64)
    for p in anchors:
        pos = torch.arange(p + 1, p + 1 + k)
        logits, conf = draft_logits(model, cache, ids[p + 1: p + 1 + k], pos)
        t = teacher[p + 1: p + 1 + k]
        ce = -(t.exp() * torch.log_softmax(logits.float(), dim=-1)).sum(dim=-1)
        agree = (logits.argmax(dim=-1) == t.argmax(dim=-1)).cumprod(dim=0)
        bce = F.binary_cross_entropy_with_logits(conf.float(), agree.float(), reduction="none")
        loss = loss + (ce + bce).sum()
        accepted += agree.numpy()
    return loss / (len(anchors) * k), {"accepted": accepted, "blocks": len(anchors)}


@torch.no_grad()
def continuations(model: Transformer, stream: np.ndarray, count: int, prompt_len: int, length: int,
                  seed: int) -> list[torch.Tensor]:
    """The main model's own text: ``count`` sequences of a corpus prompt (``prompt_len`` tokens at a seeded
    random offset) followed by ``length − prompt_len`` generated tokens, greedy for even i and sampled at
    temperature 0.7 for odd i (what the drafter must predict when serving)."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        o = int(rng.integers(0, len(stream) - prompt_len))
        ids = torch.from_numpy(stream[o: o + prompt_len].copy())
        cache = model.new_cache()
        last = model.forward_chunk(ids, cache)[-1]
        toks = ids.tolist()
        while len(toks) < length:
            t = int(last.argmax()) if i % 2 == 0 else int(torch.multinomial(torch.softmax(last / 0.7, -1), 1,
                                                                              generator=g))
            toks.append(t)
            last = model.forward_chunk(torch.tensor([t]), cache)[-1]
        out.append(torch.tensor(toks))
    return out


def train_drafter(main: Path, out: Path, *, steps: int, minutes: float, seq_len: int, batch: int, anchors: int,
                  lr: float, seed: int, corpus_root: Path | None = None, manifest: Path = MANIFEST,
                  threads: int = 2, self_distill: int = 0, prompt_len: int = 32, log=print) -> dict:
    """Train ``mtp.*`` of the checkpoint ``main`` and write the whole model to ``out`` (checkpoint formats;
    ``drafter_log.json``). Raises ValueError when the corpus differs from the manifest."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_docs, _ = split(load_corpus(corpus_root, manifest), manifest)
    model = loader.load(main)
    tokenizer = Tokenizer.from_file(str(Path(main) / "tokenizer.json"))
    stream = token_stream(tokenizer, train_docs, model.cfg.eos_token_ids[0])
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp.") and p.is_floating_point())
    fake = quantization_aware(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = np.random.default_rng(seed)
    k = model.cfg.dspark_block_size
    pool = continuations(model, stream, self_distill, prompt_len, seq_len, seed) if self_distill else None
    first = prompt_len - 1 if pool else seq_len // 4  # anchors inside the generated part of a continuation
    record = {"main": str(main), "seed": seed, "seq_len": seq_len, "batch": batch, "anchors": anchors, "lr": lr,
              "block_size": k, "self_distill": self_distill, "prompt_len": prompt_len, "curve": []}
    start, step = time.perf_counter(), 0
    while step < steps and time.perf_counter() - start < minutes * 60:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        opt.zero_grad(set_to_none=True)
        accepted, blocks, total = np.zeros(k, dtype=np.int64), 0, 0.0
        with parametrize.cached():
            for o in rng.integers(0, len(pool) if pool else len(stream) - seq_len, size=batch):
                ids = pool[o] if pool else torch.from_numpy(stream[o: o + seq_len])
                loss, stats = sequence_loss(model, ids, rng.integers(first, seq_len - k - 1, size=anchors))
                (loss / batch).backward()
                total += float(loss.detach()) / batch
                accepted += stats["accepted"]
                blocks += stats["blocks"]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        point = {"step": step, "loss": total, "accepted_per_position": (accepted / blocks).round(3).tolist(),
                 "seconds": round(time.perf_counter() - start, 1)}
        record["curve"].append(point)
        log(json.dumps(point))
    bake(fake)
    record["steps"] = step
    export(model, Path(main), out)
    (out / "drafter_log.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--main", type=Path, required=True, help="the trained main model's checkpoint")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=16, help="draft blocks per sequence")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--self-distill", type=int, default=0,
                    help="train on this many of the main model's own continuations (0: the corpus text)")
    ap.add_argument("--prompt-len", type=int, default=32, help="corpus prompt length of each continuation")
    a = ap.parse_args(argv)
    train_drafter(a.main, a.out, steps=a.steps, minutes=a.minutes, seq_len=a.seq_len, batch=a.batch,
                  anchors=a.anchors, lr=a.lr, seed=a.seed, threads=a.threads, self_distill=a.self_distill,
                  prompt_len=a.prompt_len)


if __name__ == "__main__":
    main()
