"""The text the embedded tiny model is trained on (issue 14): a fixed list of CPython 3.11 standard-library
modules, present wherever the README's interpreter is installed, pinned by the sha256 manifest
``data/train_corpus.json`` so that training refuses any other text. Files named ``heldout`` there are never
trained on; they measure the held-out loss and the drafter's acceptance.

    docs = load_corpus()              # every file, checked against the manifest
    train, heldout = split(docs)      # by the manifest's list, not by chance
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MANIFEST = Path(__file__).resolve().parent / "data" / "train_corpus.json"


@dataclass(frozen=True)
class Document:
    """One corpus file: ``name`` relative to the standard library, ``text`` (UTF-8)."""

    name: str
    text: str


def manifest(path: Path = MANIFEST) -> dict:
    """The manifest: ``{"python": "3.11", "files": {name: sha256}, "heldout": [name, ...]}``."""
    return json.loads(path.read_text())


def load_corpus(root: Path | None = None, path: Path = MANIFEST) -> list[Document]:
    """Every manifest file under ``root`` (default: this interpreter's standard library), in manifest order.

    Raises ValueError naming the files that are missing or whose sha256 differs (another Python release), so a
    model is never trained on text other than the pinned one."""
    m = manifest(path)
    root = Path(root or sysconfig.get_paths()["stdlib"])
    docs, bad = [], []
    for name, digest in m["files"].items():
        f = root / name
        data = f.read_bytes() if f.is_file() else None
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            bad.append(name if data is not None else f"{name} (missing)")
            continue
        docs.append(Document(name, data.decode("utf-8")))
    if bad:
        raise ValueError(f"the training corpus under {root} differs from {path.name} (Python {m['python']} "
                         f"standard library expected): {', '.join(bad)}")
    return docs


def split(docs: list[Document], path: Path = MANIFEST) -> tuple[list[Document], list[Document]]:
    """(train, held-out) by the manifest's ``heldout`` list."""
    held = set(manifest(path)["heldout"])
    return [d for d in docs if d.name not in held], [d for d in docs if d.name in held]


def write_manifest(names: list[str], heldout: list[str], root: Path | None = None, path: Path = MANIFEST) -> None:
    """Pin ``names`` (relative to ``root``, default this interpreter's standard library) by their sha256."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = {n: hashlib.sha256((root / n).read_bytes()).hexdigest() for n in names}
    version = sysconfig.get_python_version()
    path.write_text(json.dumps({"python": version, "files": files, "heldout": heldout}, indent=1) + "\n")
