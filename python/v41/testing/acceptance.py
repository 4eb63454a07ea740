"""Offline DSpark acceptance of a checkpoint's drafter, free-running with the reference model (issue 14;
docs/speculative-decoding.md §5 metrics).

    python -m v41.testing.acceptance --model /tmp/drafted [--tokens 2000] [--k 5]

From each held-out prompt (a window of the held-out corpus files) the loop runs: the main model's greedy token
after the verified prefix is the anchor; the drafter proposes K tokens (:meth:`Transformer.draft`, greedy);
the main model verifies them greedily on a copy of the cache; the anchor and the accepted prefix are
committed, and generation continues from there, until ``tokens`` tokens were generated. Reported as the metrics
of docs/speculative-decoding.md define them: every block verifies its K draft tokens (one target pass); per
position i accepted_i / verified_i and the conditional accepted_i / accepted_{i−1}; the acceptance rate pooled
over draft tokens (accepted / (K · blocks)); the mean acceptance length 1 + accepted / blocks.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from ..models.reference import loader
from ..models.reference.model import Transformer
from .corpus import MANIFEST, load_corpus, split
from .train import token_stream


@torch.no_grad()
def measure(model: Transformer, prompts: list[torch.Tensor], tokens: int, k: int) -> dict:
    """Greedy free-running acceptance over ``prompts`` (each [T] int64) until ``tokens`` are generated."""
    k = min(k, model.cfg.dspark_block_size)
    verified, accepted, blocks, generated = np.zeros(k, np.int64), np.zeros(k, np.int64), 0, 0
    per_prompt = -(-tokens // len(prompts))
    for prompt in prompts:
        cache = model.new_cache()
        last = model.forward_chunk(prompt, cache)[-1]
        end = min(tokens, generated + per_prompt)
        while generated < end:
            anchor = int(last.argmax())
            drafts = model.draft(cache, anchor).tokens[:k]
            check = model.forward_chunk(torch.tensor([anchor] + drafts.tolist()), copy.deepcopy(cache))
            n = 0
            while n < k and int(check[n].argmax()) == int(drafts[n]):
                n += 1
            verified += 1  # the target scores all K drafts in one pass
            accepted[:n] += 1
            blocks += 1
            commit = torch.tensor([anchor] + drafts[:n].tolist())
            last = model.forward_chunk(commit, cache)[-1]
            generated += commit.shape[0]
    reached = np.concatenate([[blocks], accepted[:-1]])
    pooled = float(accepted.sum() / max(1, verified.sum()))
    return {"k": k, "blocks": blocks, "generated": generated, "verified": verified.tolist(),
            "accepted": accepted.tolist(), "per_position": (accepted / np.maximum(verified, 1)).round(4).tolist(),
            "conditional": (accepted / np.maximum(reached, 1)).round(4).tolist(),
            "pooled_acceptance": round(pooled, 4), "mean_acceptance_length": round(1 + accepted.sum() / blocks, 3)}


def heldout_prompts(model_dir: Path, eos_id: int, length: int, count: int, corpus_root: Path | None = None,
                    manifest: Path = MANIFEST) -> list[torch.Tensor]:
    """``count`` prompts of ``length`` tokens, evenly spaced over the held-out files' token stream."""
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    _, held = split(load_corpus(corpus_root, manifest), manifest)
    stream = token_stream(tokenizer, held, eos_id)
    starts = np.linspace(0, len(stream) - length - 1, count).astype(np.int64)
    return [torch.from_numpy(stream[s: s + length].copy()) for s in starts]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--k", type=int, default=5, help="drafts verified per block (≤ dspark_block_size)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=20)
    a = ap.parse_args(argv)
    model = loader.load(a.model)
    prompts = heldout_prompts(a.model, model.cfg.eos_token_ids[0], a.prompt_len, a.prompts)
    print(json.dumps(measure(model, prompts, a.tokens, a.k)))


if __name__ == "__main__":
    main()
