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
(distillation), and the binary cross-entropy of the confidence logit ``c_i`` against "draft i+1 is accepted by
greedy verification given that the drafts before it were" (the drafter's argmax equals the main model's at i,
counted only where it did at every earlier position): ``σ(c_i)`` is the conditional acceptance probability whose
product over ``i < t`` adaptive verification takes as the survival of draft ``t``
(docs/speculative-decoding.md §4). Only ``mtp.*`` trains (quantization-aware, as the main model), or with
``--train confidence`` only the confidence head (the drafts stay bit-identical); the main model's embedding and
LM head are shared and frozen.
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
from ..models.reference.dspark import write_context
from ..models.reference.model import Transformer
from ..models.reference.ops import hc_collapse, sink_attention, window_visible
from ..models.reference.state import RequestCache
from .corpus import MANIFEST, load_corpus, split
from .train import bake, export, lr_at, quantization_aware, token_stream

TRAINED = {"drafter": "mtp.", "confidence": "mtp.{last}.confidence_head."}  # --train → trained name prefix


def draft_logits(model: Transformer, ring: list[torch.Tensor], tokens: torch.Tensor, pos: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft blocks at once, teacher-forced and differentiable: :meth:`Transformer.draft` for each block,
    with ``out_i = tokens[a, i]`` in the Markov head (``tokens[a, 0]`` is the anchor).

    ring: per stage the context KV rows [T, hd] of positions 0..T−1 (:func:`write_context`); tokens, pos: [A, K]
    (block a covers positions P_a+1..P_a+K, P_a + 1 ≤ T). The A·K rows run as one chunk: each row sees the ring
    rows of its own anchor's window (positions ≤ P_a, as :class:`DSparkAttention` does) and the K rows of its
    own block, nothing else. Returns (Markov-corrected logits [A, K, V], confidence logits [A, K])."""
    cfg = model.cfg
    a, k = tokens.shape
    ids = tokens.clone()
    ids[:, 1:] = cfg.dspark_noise_token_id
    ids, flat_pos = ids.flatten(), pos.flatten()
    block_of = torch.arange(a).repeat_interleave(k)
    ring_vis = window_visible((pos[:, 0] - 1).repeat_interleave(k), torch.arange(ring[0].shape[0]),
                              cfg.sliding_window)
    visible = torch.cat([ring_vis, block_of[:, None] == block_of[None, :]], dim=1)

    def attend(x: torch.Tensor, s: int) -> torch.Tensor:
        attn = model.mtp[s].attn
        q, _ = attn.project_q(x, flat_pos)
        keys = torch.cat([ring[s], attn.window_kv(x, flat_pos)], dim=0)
        return attn.output(sink_attention(q, keys, visible, attn.attn_sink, attn.head_dim ** -0.5), flat_pos)

    h = model.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    pre_mix = torch.zeros(a * k, cfg.hc_mult, dtype=h.dtype)
    pre_mix[:, 0] = 1
    for s, stage in enumerate(model.mtp):
        h, pre_mix = stage(h, pre_mix, ids, lambda x, s=s: attend(x, s))
    last = model.mtp[-1]
    y = hc_collapse(h, pre_mix)
    e = last.markov_head.embed.weight[tokens.flatten()]
    logits = model.head(last.norm(y)) + last.markov_head.head(e)
    conf = last.confidence_head.proj(torch.cat([y, e], dim=-1))[:, 0]
    return logits.view(a, k, -1), conf.view(a, k)


def sequence_loss(model: Transformer, ids: torch.Tensor, anchors: np.ndarray,
                  teacher: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict]:
    """Drafter loss of one sequence ``ids`` [T] at verified positions ``anchors`` (each P ≤ T − K − 2), and
    the greedy acceptance counts per block position (module docstring). ``teacher``: the frozen main model's
    (log-probabilities [T, V], aux streams [T, n·D]) of ``ids`` when already computed (:func:`teacher_of`)."""
    k = model.cfg.dspark_block_size
    log_p, aux = teacher if teacher is not None else teacher_of(model, ids)
    cache = RequestCache()
    write_context(model.mtp, aux, torch.arange(ids.shape[0]), cache)
    starts = torch.as_tensor(np.asarray(anchors), dtype=torch.int64)[:, None] + 1 + torch.arange(k)  # [A, K]
    logits, conf = draft_logits(model, cache.dspark_kv, ids[starts], starts)
    t = log_p[starts]
    ce = -(t.exp() * torch.log_softmax(logits.float(), dim=-1)).sum(dim=-1)
    hit = logits.argmax(dim=-1) == t.argmax(dim=-1)
    agree = hit.cumprod(dim=1)
    reached = torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1]], dim=1).float()  # drafts before i accepted
    bce = F.binary_cross_entropy_with_logits(conf.float(), hit.float(), reduction="none") * reached
    return ce.mean() + bce.sum() / reached.sum(), {"accepted": agree.sum(dim=0).numpy(), "blocks": len(anchors)}


@torch.no_grad()
def teacher_of(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen main model on ``ids`` [T]: (next-token log-probabilities [T, V] fp32, aux streams [T, n·D])."""
    target, aux = model.forward_chunk(ids, model.new_cache(), return_aux=True)
    return torch.log_softmax(target.float(), dim=-1), aux


def continuations(model_dir: Path, stream: np.ndarray, count: int, prompt_len: int, length: int,
                  seed: int) -> list[torch.Tensor]:
    """The main model's own text: ``count`` sequences of a corpus prompt (``prompt_len`` tokens at a seeded
    random offset) followed by ``length − prompt_len`` generated tokens, greedy for even i and sampled at
    temperature 0.7 (seed ``seed + i``) for odd i: what the drafter must predict when serving. Generated in
    one batch by the engine (:class:`v41.LLM` on the CPU, EOS ignored); the teacher distributions come from
    the oracle afterwards (:func:`teacher_of`), so a near-tie the engine breaks the other way costs nothing."""
    from ..engine.llm import LLM
    from ..engine.params import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [stream[o: o + prompt_len].tolist() for o in rng.integers(0, len(stream) - prompt_len, size=count)]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.7, seed=seed + i, ignore_eos=True,
                             max_tokens=length - prompt_len) for i in range(count)]
    with LLM(str(model_dir), device="cpu", max_num_seqs=64, max_model_len=max(256, length),
             enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [torch.tensor(p + list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]


def train_drafter(main: Path, out: Path, *, steps: int, minutes: float, seq_len: int, batch: int, anchors: int,
                  lr: float, seed: int, corpus_root: Path | None = None, manifest: Path = MANIFEST,
                  threads: int = 2, self_distill: int = 0, prompt_len: int = 32, train: str = "drafter",
                  log=print) -> dict:
    """Train ``mtp.*`` (``train="drafter"``) or only its confidence head (``"confidence"``) of the checkpoint
    ``main`` and write the whole model to ``out`` (checkpoint formats; ``drafter_log.json``). Raises ValueError
    when the corpus differs from the manifest or ``train`` is neither."""
    if train not in TRAINED:
        raise ValueError(f"train must be one of {sorted(TRAINED)}, got {train!r}")
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_docs, _ = split(load_corpus(corpus_root, manifest), manifest)
    model = loader.load(main)
    tokenizer = Tokenizer.from_file(str(Path(main) / "tokenizer.json"))
    stream = token_stream(tokenizer, train_docs, model.cfg.eos_token_ids[0])
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(TRAINED[train].format(last=model.cfg.num_nextn_predict_layers - 1))
                         and p.is_floating_point())
    fake = quantization_aware(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = np.random.default_rng(seed)
    k = model.cfg.dspark_block_size
    pool = continuations(main, stream, self_distill, prompt_len, seq_len, seed) if self_distill else None
    teachers = [teacher_of(model, ids) for ids in pool] if pool else None  # the main model is frozen
    first = prompt_len - 1 if pool else seq_len // 4  # anchors inside the generated part of a continuation
    record = {"main": str(main), "seed": seed, "seq_len": seq_len, "batch": batch, "anchors": anchors, "lr": lr,
              "block_size": k, "self_distill": self_distill, "prompt_len": prompt_len, "train": train, "curve": []}
    start, step = time.perf_counter(), 0
    while step < steps and time.perf_counter() - start < minutes * 60:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        opt.zero_grad(set_to_none=True)
        accepted, blocks, total = np.zeros(k, dtype=np.int64), 0, 0.0
        with parametrize.cached():
            for o in rng.integers(0, len(pool) if pool else len(stream) - seq_len, size=batch):
                ids = pool[o] if pool else torch.from_numpy(stream[o: o + seq_len])
                loss, stats = sequence_loss(model, ids, rng.integers(first, seq_len - k - 1, size=anchors),
                                            teachers[o] if pool else None)
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
    ap.add_argument("--train", choices=sorted(TRAINED), default="drafter",
                    help="what learns: every mtp.* weight, or only the confidence head (drafts unchanged)")
    a = ap.parse_args(argv)
    train_drafter(a.main, a.out, steps=a.steps, minutes=a.minutes, seq_len=a.seq_len, batch=a.batch,
                  anchors=a.anchors, lr=a.lr, seed=a.seed, threads=a.threads, self_distill=a.self_distill,
                  prompt_len=a.prompt_len, train=a.train)


if __name__ == "__main__":
    main()
