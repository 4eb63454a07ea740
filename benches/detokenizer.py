"""Host time of the incremental detokenizer per generated token (``v41.engine.detokenizer``): the embedded tiny
model's tokenizer streams the ids of a text one push per token, with no stop string, one, and three, as an engine
step does for each running request; then ``--invalid`` lone continuation bytes (a run of bytes that completes no
character). Each through the ByteLevel path (``engine/byte_level_text.py``, the tokenizer as it is) and through the
``DecodeStream`` path (the same tokenizer with its decoder wrapped in a ``Sequence``, which that path takes). Prints
µs per token (the mean over ``--tokens`` pushes, best of ``--runs``).

    python benches/detokenizer.py [--tokens 20000] [--runs 3] [--text README.md] [--invalid 2000]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders

from v41.engine.detokenizer import IncrementalDetokenizer
from v41.engine.llm import model_or_embedded

STOPS = {"no stop": [], "1 stop": ["\n\n\n"], "3 stops": ["</s>", "User:", "\n\n"]}


def us_per_token(tok: Tokenizer, ids: list[int], stops: list[str], n: int) -> float:
    """Push ``n`` ids one at a time (a new detokenizer whenever a stop string ends the text)."""
    d = IncrementalDetokenizer(tok, ids[:5], stop=stops)
    t = time.perf_counter()
    for i in range(n):
        d.push([ids[5 + i % (len(ids) - 5)]])
        if d.stop_hit is not None:
            d = IncrementalDetokenizer(tok, ids[:5], stop=stops)
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    ap.add_argument("--invalid", type=int, default=2000, help="length of the run of lone continuation bytes")
    a = ap.parse_args()
    tok = Tokenizer.from_file(str(Path(model_or_embedded(None)) / "tokenizer.json"))
    generic = Tokenizer.from_str(tok.to_str())
    generic.decoder = decoders.Sequence([generic.decoder])
    ids = tok.encode(Path(a.text).read_text(encoding="utf-8")).ids
    lone = tok.token_to_id("\u0122")  # GPT-2's symbol of byte 0x80
    for label, t in (("ByteLevel", tok), ("DecodeStream", generic)):
        cells = [f"{name}: {min(us_per_token(t, ids, stops, a.tokens) for _ in range(a.runs)):.2f}"
                 for name, stops in STOPS.items()]
        run = min(us_per_token(t, ids[:5] + [lone] * a.invalid, [], a.invalid) for _ in range(a.runs))
        print(f"{label}: " + ", ".join(cells) + f", {a.invalid:,} invalid bytes: {run:.2f} µs/token")


if __name__ == "__main__":
    main()
