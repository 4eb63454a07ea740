"""Train the tiny V4.1 main model on the pinned corpus (issue 14, step 1; the drafter stages come next).

    python -m v41.testing.train --out /tmp/trained [--minutes 60] [--steps N] [--seq-len 128] [--batch 8]

The model starts from the random tiny checkpoint (:func:`v41.testing.tiny.make_tiny`, every V4.1 layer role)
and trains through the reference model's own forward with gradients enabled (:func:`sequence_logits`): the
oracle's math is what is trained, so nothing needs checking against it, at the price of speed (one sequence
per call). The indexer's top-k, the candidate blocks and the routers pass no gradient to their selections.
The DSpark stages (``mtp.*``) are frozen here. AdamW with warm-up and cosine decay, gradients clipped to 1;
seeded and deterministic on the CPU for a given thread count. Quantization-aware by default (:class:`FakeQuant`:
the forward sees FP8 / MXFP4 / BF16 weights as the checkpoint stores them), so the export in the checkpoint
formats is exact; the exported model is reloaded and its held-out loss measured again; ``train_log.json`` keeps
the curve.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.nn.utils import parametrize

from .. import quant
from ..checkpoint_names import fp8_block, storage_format
from ..models.reference import loader
from ..models.reference.model import Transformer
from .corpus import MANIFEST, Document, load_corpus, split
from .tiny import make_tiny, save_weights


def sequence_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """Differentiable logits [T, vocab] of one sequence ``ids`` [T]: the oracle's whole-sequence call (one
    chunk on an empty cache) without its ``no_grad`` decorator."""
    return Transformer.forward_chunk.__wrapped__(model, ids, model.new_cache())


def trainable(model: Transformer) -> list[torch.nn.Parameter]:
    """The main model's floating-point parameters (``mtp.*`` stays frozen), switched to ``requires_grad``."""
    params = []
    for name, p in model.named_parameters():
        train = p.is_floating_point() and not name.startswith("mtp.")
        p.requires_grad_(train)
        if train:
            params.append(p)
    return params


class FakeQuant(torch.nn.Module):
    """Quantization-aware training: the forward sees the weight as the checkpoint will store it (FP8
    block-scaled, MXFP4 or BF16 by ``storage_format``), the gradient passes straight through to the float
    weight."""

    def __init__(self, fmt: str, block: tuple[int, int]):
        super().__init__()
        self.fmt, self.block = fmt, block

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.fmt == "fp8":
                q = quant.dequant_fp8_block(*quant.quant_fp8_block(w, self.block), self.block).to(w.dtype)
            elif self.fmt == "mxfp4":
                q = quant.dequant_mxfp4(*quant.quant_mxfp4(w)).to(w.dtype)
            else:
                q = w.to(torch.bfloat16).to(w.dtype)
        return w + (q - w).detach()


def quantization_aware(model: Transformer) -> list[tuple[torch.nn.Module, str]]:
    """Parametrize every trainable FP8 / MXFP4 / BF16 tensor with :class:`FakeQuant`; returns (module,
    attribute) pairs for :func:`bake`."""
    done = []
    for name, p in list(model.named_parameters()):
        fmt = storage_format(name, model.cfg.expert_dtype)
        if not p.requires_grad or fmt not in ("fp8", "mxfp4", "bf16"):
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        block = fp8_block(name, model.cfg.weight_block_size) if fmt == "fp8" else (1, 1)
        parametrize.register_parametrization(module, attr, FakeQuant(fmt, block))
        done.append((module, attr))
    return done


def bake(pairs: list[tuple[torch.nn.Module, str]]) -> None:
    """Replace each parametrized tensor by its quantized value (exactly what the checkpoint will hold)."""
    for module, attr in pairs:
        parametrize.remove_parametrizations(module, attr, leave_parametrized=True)


def token_stream(tokenizer: Tokenizer, docs: list[Document], eos_id: int) -> np.ndarray:
    """Every document's ids, each followed by EOS, as one int64 stream."""
    ids: list[int] = []
    for d in docs:
        ids += tokenizer.encode(d.text, add_special_tokens=False).ids + [eos_id]
    return np.asarray(ids, dtype=np.int64)


def heldout_loss(model: Transformer, stream: np.ndarray, seq_len: int, windows: int) -> float:
    """Mean next-token cross-entropy (nats) over the first ``windows`` non-overlapping windows of ``stream``."""
    losses = []
    with torch.no_grad():
        for w in range(min(windows, (len(stream) - 1) // seq_len)):
            chunk = torch.from_numpy(stream[w * seq_len: (w + 1) * seq_len + 1])
            logits = model.forward_chunk(chunk[:-1], model.new_cache())
            losses.append(float(F.cross_entropy(logits.float(), chunk[1:])))
    return float(np.mean(losses))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to peak / 10 at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(out: Path, *, steps: int, minutes: float, seq_len: int, batch: int, lr: float, seed: int,
          eval_every: int, eval_windows: int, corpus_root: Path | None = None, manifest: Path = MANIFEST,
          threads: int = 2, qat: bool = True, log=print) -> dict:
    """Train and export to ``out`` (module docstring); returns the log written to ``out/train_log.json``.
    Raises ValueError when the corpus differs from the manifest."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    out = Path(out)
    train_docs, held_docs = split(load_corpus(corpus_root, manifest), manifest)
    init = make_tiny(out / "init", "deepseek_v41", seed=seed)
    model = loader.load(init).train()
    tokenizer = Tokenizer.from_file(str(init / "tokenizer.json"))
    eos = model.cfg.eos_token_ids[0]
    train_ids, held_ids = token_stream(tokenizer, train_docs, eos), token_stream(tokenizer, held_docs, eos)
    trainable(model)
    fake = quantization_aware(model) if qat else []
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = np.random.default_rng(seed)
    record = {"seed": seed, "seq_len": seq_len, "batch": batch, "lr": lr, "threads": threads, "qat": qat,
              "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)),
              "corpus": [d.name for d in train_docs], "heldout": [d.name for d in held_docs],
              "uniform_loss": math.log(model.cfg.vocab_size), "curve": []}
    record["heldout_loss_init"] = heldout_loss(model, held_ids, seq_len, eval_windows)
    log(f"{len(train_ids)} training / {len(held_ids)} held-out tokens; held-out loss at init "
        f"{record['heldout_loss_init']:.3f} (uniform {record['uniform_loss']:.3f})")
    start = time.perf_counter()
    step = 0
    while step < steps and time.perf_counter() - start < minutes * 60:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        offsets = rng.integers(0, len(train_ids) - seq_len - 1, size=batch)
        opt.zero_grad(set_to_none=True)
        with parametrize.cached():  # one fake quantization per step, shared by the batch's sequences
            loss = sum(F.cross_entropy(sequence_logits(model, c[:-1]).float(), c[1:])
                       for c in (torch.from_numpy(train_ids[o: o + seq_len + 1]) for o in offsets)) / batch
            loss.backward()
        loss_sum = float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        point = {"step": step, "loss": loss_sum, "seconds": round(time.perf_counter() - start, 1)}
        if step % eval_every == 0:
            point["heldout_loss"] = heldout_loss(model, held_ids, seq_len, eval_windows)
        record["curve"].append(point)
        log(json.dumps(point))
    record["steps"] = step
    bake(fake)
    record["heldout_loss"] = heldout_loss(model, held_ids, seq_len, eval_windows)
    export(model, init, out)
    record["heldout_loss_quantized"] = heldout_loss(loader.load(out).eval(), held_ids, seq_len, eval_windows)
    log(f"after {step} steps: held-out loss {record['heldout_loss']:.3f}, in the checkpoint formats "
        f"{record['heldout_loss_quantized']:.3f}")
    (out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def export(model: Transformer, source: Path, out: Path) -> None:
    """The model's weights in the checkpoint formats, with ``source``'s config, generation config and tokenizer."""
    for name in CHECKPOINT_FILES:
        shutil.copyfile(Path(source) / name, Path(out) / name)
    save_weights(out, model.cfg, model.state_dict())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (the schedule's length)")
    ap.add_argument("--minutes", type=float, default=60.0, help="stop earlier after this wall time")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-qat", dest="qat", action="store_false",
                    help="train plain float weights (default: quantization-aware, see FakeQuant)")
    a = ap.parse_args(argv)
    train(a.out, steps=a.steps, minutes=a.minutes, seq_len=a.seq_len, batch=a.batch, lr=a.lr, seed=a.seed,
          eval_every=a.eval_every, eval_windows=a.eval_windows, threads=a.threads, qat=a.qat)


if __name__ == "__main__":
    main()
