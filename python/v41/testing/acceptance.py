"""Offline DSpark acceptance of a checkpoint's drafter, free-running with the reference model (issue 14;
docs/speculative-decoding.md §5 metrics).

    python -m v41.testing.acceptance --model /tmp/drafted [--tokens 2000] [--k 5] [--temperature 0.7]

From each held-out prompt (a window of the held-out corpus files) the loop runs: the main model's token after the
verified prefix is the anchor; the drafter proposes K tokens (:meth:`Transformer.draft`, greedy or sampled); the
main model verifies them (greedily, or token-wise at a temperature: :func:`measure`) on a copy of the cache; the
anchor and the accepted prefix are committed, and generation continues from there, until ``tokens`` tokens were
generated. Reported as the metrics of docs/speculative-decoding.md define them: every block verifies its K draft
tokens (one target pass); per position i accepted_i / verified_i and the conditional accepted_i / accepted_{i−1};
the acceptance rate pooled over draft tokens (accepted / (K · blocks)); the mean acceptance length 1 + accepted /
blocks.
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
def measure(model: Transformer, prompts: list[torch.Tensor], tokens: int, k: int, temperature: float = 0.0,
            seed: int = 0) -> dict:
    """Free-running acceptance over ``prompts`` (each [T] int64) until ``tokens`` are generated.

    Temperature 0: greedy drafts, a draft is accepted while it equals the target's argmax. Temperature T > 0:
    drafts sampled from the drafter's q = softmax(l/T), verified token-wise (docs/speculative-decoding.md §3): draft
    x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), p = the target's softmax(l/T); the first
    rejection resamples from normalise(max(0, p − q)) and ends the block, and after K acceptances the next token
    is drawn from the target, so the text is distributed as the target's own samples. Seeded (``seed``)."""
    k = min(k, model.cfg.dspark_block_size)
    gen = torch.Generator().manual_seed(seed)
    verified, accepted, blocks, generated = np.zeros(k, np.int64), np.zeros(k, np.int64), 0, 0
    per_prompt = -(-tokens // len(prompts))

    def pick(logits: torch.Tensor) -> int:
        if temperature <= 0:
            return int(logits.argmax())
        return int(torch.multinomial(torch.softmax(logits.double() / temperature, -1), 1, generator=gen))

    for prompt in prompts:
        cache = model.new_cache()
        anchor = pick(model.forward_chunk(prompt, cache)[-1])
        end = min(tokens, generated + per_prompt)
        while generated < end:
            block = model.draft(cache, anchor, temperature, gen if temperature > 0 else None)
            drafts = block.tokens[:k]
            check = model.forward_chunk(torch.tensor([anchor] + drafts.tolist()), copy.deepcopy(cache))
            n, after = 0, None
            while n < k:
                x = int(drafts[n])
                if temperature <= 0:
                    if int(check[n].argmax()) != x:
                        break
                else:
                    p = torch.softmax(check[n].double() / temperature, -1)
                    q = torch.softmax(block.logits[n].double() / temperature, -1)
                    if float(torch.rand((), generator=gen, dtype=torch.float64)) >= min(1.0, float(p[x] / q[x])):
                        residual = (p - q).clamp(min=0)
                        after = int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
                        break
                n += 1
            verified += 1  # the target scores all K drafts in one pass
            accepted[:n] += 1
            blocks += 1
            commit = torch.tensor([anchor] + drafts[:n].tolist())
            last = model.forward_chunk(commit, cache)[-1]
            anchor = pick(last) if after is None else after
            generated += commit.shape[0]
    reached = np.concatenate([[blocks], accepted[:-1]])
    pooled = float(accepted.sum() / max(1, verified.sum()))
    return {"k": k, "temperature": temperature, "blocks": blocks, "generated": generated,
            "verified": verified.tolist(), "accepted": accepted.tolist(),
            "per_position": (accepted / np.maximum(verified, 1)).round(4).tolist(),
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
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled, token-wise verification")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    model = loader.load(a.model)
    prompts = heldout_prompts(a.model, model.cfg.eos_token_ids[0], a.prompt_len, a.prompts)
    print(json.dumps(measure(model, prompts, a.tokens, a.k, a.temperature, a.seed)))


if __name__ == "__main__":
    main()
