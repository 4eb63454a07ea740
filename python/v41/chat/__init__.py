"""Chat format of DeepSeek-V4.1 / V4: prompt encoding and output parsing (docs/model.md §7).

* :func:`encode_messages` -- OpenAI-style messages -> prompt token ids (``encoding.py``);
  :func:`encode_chat` also returns the prompt string and the image parts; :func:`render_messages` gives
  the reference prompt string (tests, debugging).
* :class:`OutputParser` -- generated ids -> reasoning, content and OpenAI-shaped tool calls, incrementally
  (``parser.py``, with ``reasoning.py`` and ``dsml.py``).

Module map: ``formats.py`` (format data), ``normalize.py`` (§7.3), ``render.py`` (§7.4, §7.8), ``tools.py``
(§7.5, §7.6), ``segments.py`` and ``tokens.py`` (docs/numerics.md §4 tokenization), ``textscan.py``/``deltas.py``
(parser helpers and output types), ``jsontext.py`` (strict JSON of tool-call values, §7.10a).
"""

from .deltas import ParserDelta, ParserResult, ToolCallDelta
from .encoding import EncodedPrompt, encode_chat, encode_messages, render_messages
from .formats import REVISIONS
from .parser import OutputParser

__all__ = [
    "REVISIONS",
    "EncodedPrompt",
    "OutputParser",
    "ParserDelta",
    "ParserResult",
    "ToolCallDelta",
    "encode_chat",
    "encode_messages",
    "render_messages",
]
