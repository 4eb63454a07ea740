"""Helpers of the output-parser tests (``test_chat_parser.py``, ``test_chat_dsml.py``): feed a model output to
``v41.chat.OutputParser`` whole or in chunks, fold the streamed deltas the way an OpenAI client does, and check
that every split of the output gives the one-shot result (docs/model.md §7.10: the parse never depends on how
the output is split)."""

from __future__ import annotations

import json
import random

from v41.chat import OutputParser, ParserResult
from v41.chat import formats as F
from v41.testing.tokenizer_files import load_tiny_tokenizer

TOK = load_tiny_tokenizer()
EOS = F.EOS
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}},
]


def summary(result: ParserResult):
    """(reasoning, content, [(name, arguments)]) of a result."""
    return (
        result.reasoning_content,
        result.content,
        [(c["function"]["name"], c["function"]["arguments"]) for c in result.tool_calls],
    )


def make_parser(**kw) -> OutputParser:
    kw.setdefault("call_id_prefix", "call_")
    kw.setdefault("tools", TOOLS)
    return OutputParser(TOK, **kw)


def run(chunks, by_ids: bool, **kw):
    """Feed ``chunks`` (id lists or strings); return (result, deltas incl. the final one)."""
    parser = make_parser(**kw)
    deltas = [parser.feed(c) if by_ids else parser.feed_text(c) for c in chunks]
    result = parser.finish()
    return result, deltas + [result.final_delta]


def concatenated(deltas):
    """Fold streamed deltas the way an OpenAI client does."""
    reasoning = "".join(d.reasoning_delta for d in deltas)
    content = "".join(d.content_delta for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for t in d.tool_call_deltas:
            if t.id is not None:
                assert t.index not in calls and t.name is not None
                calls[t.index] = {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": ""}}
            calls[t.index]["function"]["arguments"] += t.arguments
    assert sorted(calls) == list(range(len(calls)))
    return reasoning or None, content, [calls[i] for i in range(len(calls))]


def check_stream(result, deltas, markers_in_data=False):
    """Deltas fold to the result; unless the data itself spells markers, no marker text leaks."""
    assert concatenated(deltas) == (result.reasoning_content, result.content, result.tool_calls)
    if markers_in_data:
        return
    for d in deltas:
        for text in [d.reasoning_delta, d.content_delta] + [t.arguments for t in d.tool_call_deltas]:
            assert "｜DSML｜" not in text and EOS not in text
        assert "</think>" not in d.content_delta and "<think>" not in d.reasoning_delta


def splits_of(seq, rng: random.Random, count: int):
    """Every 2-way split, one-by-one, all at once, and ``count`` random multi-way splits."""
    n = len(seq)
    yield [seq]
    yield [seq[i : i + 1] for i in range(n)]
    for i in range(n + 1):
        yield [seq[:i], seq[i:]]
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 8)))) if n > 1 else []
        bounds = [0, *cuts, n]
        yield [seq[a:b] for a, b in zip(bounds, bounds[1:])]


def random_chunks(text: str, rng: random.Random, max_size: int = 4) -> list[str]:
    """``text`` cut into pieces of 1..``max_size`` characters (a streamed output)."""
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, max_size)
        chunks.append(text[i : i + n])
        i += n
    return chunks


def every_split(text: str, seeds: int = 20):
    """The streamed splits of ``text`` the conformance tests feed: every 2-way split, one character at a time,
    and ``seeds`` random cuts into 1-4 character chunks."""
    yield from splits_of(text, random.Random(0), 0)
    for seed in range(seeds):
        yield random_chunks(text, random.Random(seed))


def parse_every_way(text: str, markers_in_data: bool = False, **kw) -> ParserResult:
    """The non-streaming result of ``text`` (one feed), after checking that every split of
    :func:`every_split` gives the same result and that its deltas fold to it."""
    whole, deltas = run([text], by_ids=False, **kw)
    check_stream(whole, deltas, markers_in_data)
    for chunks in every_split(text):
        result, deltas = run(chunks, by_ids=False, **kw)
        assert result == whole, chunks
        check_stream(result, deltas, markers_in_data)
    return whole


def strict_json(text: str):
    """``json.loads`` as a strict parser (RFC 8259): ``NaN`` / ``Infinity`` are errors."""

    def reject(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=reject)
