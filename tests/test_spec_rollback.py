"""Rollback and stops under speculation with a scripted drafter (docs/speculative-decoding.md §2; the design's test
plan items 2 and 5): drafts are the plain greedy continuation with one wrong token at a chosen slot, so every
accepted length ``a ∈ 0..K`` is forced, at both parities of the position and across the window wrap of every
windowed cache (the embedded model's window is 8). After each step the next verify rows must see exactly what a
plain run over the committed tokens sees: the tokens and the logprob of every committed token equal the plain
engine's. Drafted stop tokens and EOS end a request only once the target agrees."""

from __future__ import annotations

import pytest

from v41.engine.llm import LLM
from v41.engine.params import SamplingParams

PROMPTS = ["def main(args):\n    ", "import os\nimport sys\n\n"]
TOKENS = 40


def plain_run(params: SamplingParams):
    return LLM(None, max_num_seqs=2).generate(PROMPTS, params, use_tqdm=False)


def script(llm: LLM, future: dict[tuple, list[int]], wrong_slot, corrupt=None) -> list[tuple[int, int, int]]:
    """Replace the engine's drafter: each request's drafts are ``future`` after its committed tokens, with slot
    ``wrong_slot(seq, step)`` (K = none) replaced by ``corrupt(seq, token)`` (default: the next id). Returns the list
    the wrapped verification fills with (wrong slot, drafts verified, accepted) per request and step."""
    spec = llm.engine.spec
    k, verify, seen, chosen, steps = spec.k, spec.verify, [], {}, {}
    corrupt = corrupt or (lambda s, t: (t + 1) % llm.engine.cfg.vocab_size)

    def draft(seqs, table_rows):
        rows = []
        for s in seqs:
            n = len(s.output_token_ids)
            drafts = list(future[tuple(s.prompt_token_ids)][n:n + k])
            steps[s.seq_id] = steps.get(s.seq_id, -1) + 1
            j = chosen[s.seq_id] = wrong_slot(s, steps[s.seq_id])
            if j < k:
                drafts[j] = corrupt(s, drafts[j])
            s.draft, s.draft_q = drafts, None
            rows.append(drafts)
        return rows

    def checked_verify(seqs, logits, counts):
        commits = verify(seqs, logits, counts)
        seen.extend((chosen[s.seq_id], c, len(t) - 1) for s, c, t in zip(seqs, counts, commits))
        return commits

    spec.draft, spec.verify = draft, checked_verify
    return seen


@pytest.mark.parametrize("k,schedule", [(3, "cycle"), pytest.param(5, "cycle", marks=pytest.mark.slow),
                                        pytest.param(4, "right", marks=pytest.mark.slow),
                                        pytest.param(4, "wrong", marks=pytest.mark.slow)])
def test_forced_accepted_lengths_roll_back_to_the_plain_run(k, schedule):
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=1)
    longer = SamplingParams(temperature=0, max_tokens=TOKENS + k + 1, ignore_eos=True, logprobs=1)
    plain = plain_run(longer)
    future = {tuple(p.prompt_token_ids): list(p.outputs[0].token_ids) for p in plain}
    llm = LLM(None, max_num_seqs=2, speculative_config={"num_speculative_tokens": k})
    slot = {"cycle": lambda s, step: (step + s.seq_id) % (k + 1), "right": lambda s, step: k,
            "wrong": lambda s, step: 0}[schedule]
    seen = script(llm, future, slot)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    for out, ref in zip(outs, plain):
        got, want = out.outputs[0], ref.outputs[0]
        assert list(got.token_ids) == list(want.token_ids)[:TOKENS]
        for pos, (a, b) in enumerate(zip(got.logprobs, want.logprobs)):
            t = got.token_ids[pos]
            assert abs(a[t].logprob - b[t].logprob) < 1e-4, pos
    assert all(a == min(j, c) for j, c, a in seen), seen
    accepted = {a for _, _, a in seen}
    want_lengths = {"cycle": set(range(k + 1)), "right": {k}, "wrong": {0}}[schedule]
    assert want_lengths <= accepted


def test_drafted_stops_count_only_once_the_target_agrees():
    """EOS and a stop id drafted at every step (a wrong draft) never end a request; the stop id ends it where the
    plain run stops, and max_tokens cuts inside a step of accepted drafts."""
    base = plain_run(SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    ids = list(base[0].outputs[0].token_ids)
    stop = next(t for m, t in enumerate(ids) if m >= 12 and t not in ids[:m])  # first seen at position m ≥ 12
    params = [SamplingParams(temperature=0, max_tokens=TOKENS, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=TOKENS - 3)]
    plain = LLM(None, max_num_seqs=2).generate(PROMPTS, params, use_tqdm=False)
    assert plain[0].outputs[0].finish_reason == "stop" and plain[0].outputs[0].stop_reason == stop
    future = {tuple(p.prompt_token_ids): list(p.outputs[0].token_ids) + [0] * 8 for p in base}
    llm = LLM(None, max_num_seqs=2, speculative_config={"num_speculative_tokens": 4})
    eos = llm.engine.cfg.eos_token_ids[0]
    # request 0 gets its stop id as a wrong draft at slot step mod 4, request 1 EOS; the rest of each block is right
    first = tuple(base[0].prompt_token_ids)
    def corrupt(s, t):
        if tuple(s.prompt_token_ids) == first:
            return stop if t != stop else eos
        return eos if t != eos else 1

    script(llm, future, lambda s, step: step % 4, corrupt)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, ref in zip(outs, plain):
        assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == \
            (ref.outputs[0].finish_reason, ref.outputs[0].stop_reason)
    assert len(outs[1].outputs[0].token_ids) == TOKENS - 3 and outs[1].outputs[0].finish_reason == "length"
    assert eos not in outs[1].outputs[0].token_ids
