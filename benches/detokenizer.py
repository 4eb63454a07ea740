"""Host time of the incremental detokenizer per generated token (``v41.engine.detokenizer``): the embedded tiny
model's tokenizer streams the ids of a text one push per token, with no stop string, one, and three, as an engine
step does for each running request. Prints µs per token (the mean over ``--tokens`` pushes, best of ``--runs``).

    python benches/detokenizer.py [--tokens 20000] [--runs 3] [--text README.md]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tokenizers import Tokenizer

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
    a = ap.parse_args()
    tok = Tokenizer.from_file(str(Path(model_or_embedded(None)) / "tokenizer.json"))
    ids = tok.encode(Path(a.text).read_text(encoding="utf-8")).ids
    print(", ".join(f"{name}: {min(us_per_token(tok, ids, stops, a.tokens) for _ in range(a.runs)):.2f} µs/token"
                    for name, stops in STOPS.items()))


if __name__ == "__main__":
    main()
