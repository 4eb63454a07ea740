"""Build the tiny byte-level BPE tokenizer shipped in ``v41/testing/data``.

The tokenizer stands in for the real DeepSeek-V4.1 ``tokenizer.json`` in tests: same kind of model
(byte-level BPE), same special-token strings (docs/model.md §7.2), same ids for BOS/EOS/pad, but a
vocabulary of only 1024 entries so tiny checkpoints stay tiny.

Vocabulary layout (``VOCAB_SIZE`` = 1024 ids, no holes):

* ids 0, 1, 2: ``<｜begin▁of▁sentence｜>``, ``<｜end▁of▁sentence｜>``, ``<｜▁pad▁｜>`` (as in the real model);
* ids 3 .. 258: the 256 byte symbols of the ByteLevel alphabet (all bytes, so any input encodes);
* ids 259 .. 1007: BPE merges learned from ``data/corpus.txt``;
* ids 1008 .. 1023: the other §7.2 markers, in ``TAIL_SPECIAL_TOKENS`` order.

The build is deterministic: the same corpus gives the same ``tokenizer.json`` bytes every run
(``tests/test_tokenizer.py`` checks this against ``TOKENIZER_SHA256``). After changing the corpus or this
script, run ``python -m v41.testing.build_tokenizer`` and update ``TOKENIZER_SHA256`` in
``tokenizer_files.py`` with the printed hash.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_PATH = DATA_DIR / "corpus.txt"

VOCAB_SIZE = 1024

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
# Ids 0, 1, 2 -- the same ids as the real model.
HEAD_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
# The remaining §7.2 markers, appended after the learned vocabulary in this order.
TAIL_SPECIAL_TOKENS = (
    "<｜System｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜extracted_url｜>",
    "<｜read_url｜>",
    "<｜deepseek_image｜>",
    "<|place_holder_mm_span_0436|>",  # ASCII pipes, as in the real vocabulary
)
SPECIAL_TOKENS = HEAD_SPECIAL_TOKENS + TAIL_SPECIAL_TOKENS

BPE_VOCAB_SIZE = VOCAB_SIZE - len(TAIL_SPECIAL_TOKENS)  # head specials + bytes + merges
MIN_FREQUENCY = 2
MODEL_MAX_LENGTH = 1048576  # the real model's max_position_embeddings (docs/model.md §1)


def _special(content: str) -> AddedToken:
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)


def _corpus_lines(corpus_path: Path) -> list[str]:
    # Read bytes and split ourselves so newline handling does not depend on the platform.
    text = corpus_path.read_bytes().decode("utf-8")
    return text.splitlines(keepends=True)


def build_tokenizer(corpus_path: Path = CORPUS_PATH) -> Tokenizer:
    """Train the tiny tokenizer from ``corpus_path`` and return it (nothing is written)."""
    tok = Tokenizer(models.BPE())  # no unk token: the byte alphabet covers every input
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Offsets only; no template, so add_special_tokens=True never inserts BOS/EOS.
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)

    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        show_progress=False,
        special_tokens=[_special(t) for t in HEAD_SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus_lines(corpus_path), trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    assert got == BPE_VOCAB_SIZE, f"BPE training gave {got} entries, want {BPE_VOCAB_SIZE}"

    tok.add_special_tokens([_special(t) for t in TAIL_SPECIAL_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    for i, t in enumerate(HEAD_SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, t
    for i, t in enumerate(TAIL_SPECIAL_TOKENS):
        assert tok.token_to_id(t) == BPE_VOCAB_SIZE + i, t
    return tok


def tokenizer_json(tok: Tokenizer) -> bytes:
    """The exact bytes written to ``tokenizer.json``."""
    return (tok.to_str(pretty=True) + "\n").encode("utf-8")


def tokenizer_config() -> dict:
    """HF ``tokenizer_config.json`` contents for the tiny tokenizer."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def tokenizer_config_json() -> bytes:
    return (json.dumps(tokenizer_config(), ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def write_tokenizer(out_dir: Path = DATA_DIR, corpus_path: Path = CORPUS_PATH) -> str:
    """Build and write ``tokenizer.json`` and ``tokenizer_config.json``; return the sha256 of the former."""
    data = tokenizer_json(build_tokenizer(corpus_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_bytes(data)
    (out_dir / "tokenizer_config.json").write_bytes(tokenizer_config_json())
    return hashlib.sha256(data).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--corpus", type=Path, default=CORPUS_PATH)
    args = parser.parse_args()
    digest = write_tokenizer(args.out_dir, args.corpus)
    print(f"wrote {args.out_dir / 'tokenizer.json'} ({VOCAB_SIZE} ids), sha256 {digest}")


if __name__ == "__main__":
    main()
