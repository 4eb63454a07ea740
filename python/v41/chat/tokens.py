"""The tokenizer side of the chat format: marker ids, plain-text runs, loading from a model directory.

Source: docs/numerics.md §4 (chat prompt tokenization), docs/model.md §7.1 (revision from ``model_type``),
§7.2 and §11 item 6 (look every marker up at load time; fail if one is missing or not a single token).

Plain text is tokenized by a private copy of the tokenizer in which every §7.2 control marker is a special
token and special-token matching is off (``encode_special_tokens``): a user who types ``<｜User｜>`` gets
the characters, not the marker, also for markers the real ``tokenizer.json`` lists as non-special
(reportedly ``<｜System｜>``). Other added tokens keep matching as in the reference encoder. Loading costs a
JSON round trip of the tokenizer (about a second for the real 129k vocabulary); instances are cached.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

from .formats import CONTROL_MARKERS, DEFAULT_REVISION_BY_MODEL_TYPE, V41, profile
from .segments import Marker, PromptBuilder

TokenizerSource = Tokenizer | str | os.PathLike[str]
_CACHE_SIZE = 8


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` prepared for one chat format revision.

    ``marker_ids``: every marker the revision writes -> its token id. ``revision``: the format revision.
    Errors: ``ValueError`` when a marker is missing from the vocabulary or is not matched as one token.
    """

    def __init__(self, tokenizer: Tokenizer, revision: str) -> None:
        self.tokenizer = tokenizer
        self.revision = profile(revision).name
        self.marker_ids = {m: _single_token_id(tokenizer, m, revision) for m in profile(revision).markers()}
        self._plain = _plain_copy(tokenizer)

    def encode_plain(self, text: str) -> list[int]:
        """Ids of ``text`` as ordinary text (control-marker strings in it are not matched)."""
        return self._plain.encode(text, add_special_tokens=False).ids if text else []

    def encode_prompt(self, prompt: PromptBuilder) -> list[int]:
        """Ids of a prompt: markers as their ids, each maximal plain run tokenized in one piece."""
        ids: list[int] = []
        for run in prompt.runs():
            if isinstance(run, Marker):
                ids.append(self.marker_ids[run.text])
            else:
                ids.extend(self.encode_plain(run))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` with every marker spelled out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def _single_token_id(tokenizer: Tokenizer, marker: str, revision: str) -> int:
    tid = tokenizer.token_to_id(marker)
    if tid is None:
        raise ValueError(f"tokenizer has no token {marker!r}, which the {revision} chat format needs (§7.2)")
    ids = tokenizer.encode(marker, add_special_tokens=False).ids
    if ids != [tid]:
        raise ValueError(f"chat marker {marker!r} is not a single token in this tokenizer: encodes to {ids}")
    return tid


def _plain_copy(tokenizer: Tokenizer) -> Tokenizer:
    data = json.loads(tokenizer.to_str())
    control = set(CONTROL_MARKERS)
    for added in data.get("added_tokens") or []:
        if added.get("content") in control:
            added["special"] = True
    plain = Tokenizer.from_str(json.dumps(data))
    plain.encode_special_tokens = True
    return plain


def default_revision(model_dir: str | os.PathLike[str]) -> str:
    """Revision implied by ``model_dir/config.json``'s ``model_type`` (§7.1); ``v41`` without a config."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return V41
    model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    try:
        return DEFAULT_REVISION_BY_MODEL_TYPE[model_type]
    except KeyError:
        raise ValueError(
            f"{config}: model_type {model_type!r} has no chat format; expected one of "
            f"{sorted(DEFAULT_REVISION_BY_MODEL_TYPE)}"
        ) from None


def _tokenizer_file(source: str | os.PathLike[str]) -> tuple[Path, Path]:
    path = Path(source)
    file = path if path.is_file() else path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {file}")
    return file, file.parent


# Cached instances hold their Tokenizer, so an id() in a key is never reused while the entry lives.
_cache: OrderedDict[tuple[object, ...], ChatTokenizer] = OrderedDict()
_cache_lock = threading.Lock()


def chat_tokenizer(source: TokenizerSource, revision: str | None = None) -> ChatTokenizer:
    """A cached :class:`ChatTokenizer` for a ``tokenizers.Tokenizer`` or a model directory.

    ``source``: a ``Tokenizer``, a model directory, or a ``tokenizer.json`` path. ``revision`` defaults to
    the directory's ``model_type`` (``v41`` for a bare ``Tokenizer`` or a directory without config.json).
    Errors: ``FileNotFoundError`` without ``tokenizer.json``; ``ValueError`` for an unknown revision or
    a missing marker.
    """
    if revision is not None:
        profile(revision)
    key: tuple[object, ...]
    if isinstance(source, Tokenizer):
        rev = revision or V41
        key = ("object", id(source), rev)
    else:
        file, model_dir = _tokenizer_file(source)
        rev = revision or default_revision(model_dir)
        key = ("file", str(file.resolve()), file.stat().st_mtime_ns, rev)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and (not isinstance(source, Tokenizer) or hit.tokenizer is source):
            _cache.move_to_end(key)
            return hit
    tok = source if isinstance(source, Tokenizer) else Tokenizer.from_file(str(file))
    prepared = ChatTokenizer(tok, rev)
    with _cache_lock:
        _cache[key] = prepared
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return prepared
