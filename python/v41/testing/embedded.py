"""The embedded model: the tiny DeepSeek-V4.1 trained on the CPU with its DSpark drafter (issue 14), shipped inside
the package so that ``v41 generate``, ``v41-serve`` and ``v41.LLM()`` run without a model given or downloaded.

What it is: the default tiny V4.1 configuration (12 layers, every layer role, 3.1 M parameters, the 1,024-id
tiny tokenizer) trained for about an hour on two CPU cores on CPython 3.11 standard-library modules
(:mod:`.corpus`), then its three DSpark drafter stages trained against it on its own continuations. It writes
Python-shaped text; it is **not** an assistant. The files are a normal checkpoint in the checkpoint formats (FP8
block-scaled dense weights, MXFP4 experts; ``v41/embedded/``, about 3.5 MB) with the logs of how they were made:
``train_log.json`` (:mod:`.train`: settings, loss curve, held-out loss before and after quantization),
``drafter_log.json`` (:mod:`.train_drafter`) and ``acceptance.json`` (:mod:`.acceptance`, greedy and at
temperature 0.7); benches/RESULTS.md has the figures.
Random checkpoints for tests come from ``v41 init-tiny`` / :func:`.tiny.make_tiny`, never from here.
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "embedded"
REQUIRED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json")


def embedded_model_dir() -> Path:
    """The shipped checkpoint's directory. Raises FileNotFoundError naming what is missing when the install is
    incomplete (the weights come with the package; nothing is generated or downloaded)."""
    missing = [name for name in REQUIRED if not (EMBEDDED_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(f"the embedded model in {EMBEDDED_DIR} is incomplete (missing {', '.join(missing)}); "
                                "reinstall v41 or give a model")
    return EMBEDDED_DIR
