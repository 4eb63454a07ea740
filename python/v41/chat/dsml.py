"""Incremental DSML tool-call block parser (V4.1 spaced and V4 unspaced tags).

Source: docs/model.md §7.6 (block layout), §7.10 (reference and streaming parsers), §7.10a (malformed and
truncated calls), docs/known-failures.md KF-01 and KF-02.

Entered right after ``<｜DSML｜`` (the opener ``<｜DSML｜ calls>``; also ``tool_calls`` and V3.2's
``function_calls``, with or without the space). Then, tag by tag:

* ``<｜DSML｜ invoke name="NAME">`` starts a call; its first delta carries index, id and name.
  ``<｜DSML｜ invoke name="NAME"/>`` (or ``" />``) is a whole call without parameters (arguments ``{}``);
* ``<｜DSML｜ parameter name="KEY" string="true|false">VALUE`` -- the value runs to the next closing tag:
  ``</｜DSML｜`` + ``parameter>``, ``invoke>`` or a block name (any other text after ``</｜DSML｜``, as in
  ``x</｜DSML｜ paramete y``, stays in the value). A ``true`` value is a string taken verbatim and streams as
  JSON-escaped fragments while it arrives; any other value is held until it closes, then decoded strictly
  and re-serialised with ``ensure_ascii=False`` (its literal text as a JSON string when it is not strict
  JSON: ``NaN``, ``1e999``; ``jsontext.py``), and only then is the parameter (key and value) sent;
* ``</｜DSML｜ invoke>`` closes the call (arguments ``{}`` without parameters); ``</｜DSML｜ calls>`` closes the
  block and the text after it is content again (as vLLM; the reference expects EOS there);
* anything else between tags (the format's newlines, or garbage) is skipped; an unexpected tag is ignored.

Names and keys (§7.10a): a name runs to the first ``"`` -- names cannot hold one, as in the peers'
``name="([^"]+)"`` patterns -- and must be followed by the rest of its own tag; a tag that breaks off (no
``string="true|false">``, a ``"`` missing before the next ``<｜DSML｜`` / ``</｜DSML｜``) is dropped with its
value and never reaches the tags after it. An invoke with an empty or malformed name is dropped with its
parameters; the calls after it parse as usual.

End of generation inside a call (EOS, a stop, ``max_tokens``; §7.10a "truncated calls"): the call stays (its
id, name and string text were already streamed) with what is certain -- its complete parameters, a cut
string parameter's text so far, a cut ``string="false"`` parameter only when its text is already a whole
JSON value that cannot grow (``jsontext.cut_value_text``), else it is dropped, never turned into a string --
and is marked incomplete (``truncated``), so the finish reason is never ``tool_calls``.

Wrapper unwrapping (as vLLM's DeepSeek parsers; the V4 reference encoder renders an object ``arguments`` as
one ``arguments`` parameter, so models write it back): when a call's only parameter is ``arguments`` and
its value is an object (or a string holding strict JSON text of one), the call's arguments are that object
-- but only when the request's schema for the tool is known (``parameters.properties`` is an object), does
not declare ``arguments``, and declares every key of the object. Otherwise the wrapper is kept: a declared
``arguments`` is a real parameter, and without a schema there is nothing to say the wrapper is one. Such a
call's arguments are held from its ``arguments`` parameter until the call closes (or a second parameter
starts) and then sent in one delta.

The arguments of a call are the concatenation of its deltas: ``{"KEY": VALUE, ...}`` with the default
``", "``/``": "`` separators, i.e. the reference encoder's own JSON text for the values it renders.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .deltas import Emitter
from .formats import DSML, EOS
from .jsontext import cut_value_text, dumps, strict_loads, value_text
from .textscan import find_first, match_pattern, partial_tail

OPEN = "<" + DSML
CLOSE = "</" + DSML
_BLOCK_NAMES = ("calls", "tool_calls", "function_calls")


def _spellings(*names: str, suffix: str) -> tuple[str, ...]:
    return tuple(f"{space}{n}{suffix}" for n in names for space in (" ", ""))


BLOCK_TAGS = _spellings(*_BLOCK_NAMES, suffix=">")
INVOKE_OPEN = _spellings("invoke", suffix=' name="')
PARAM_OPEN = _spellings("parameter", suffix=' name="')
INVOKE_CLOSE = _spellings("invoke", suffix=">")
PARAM_CLOSE = _spellings("parameter", suffix=">")
OPEN_TAGS = BLOCK_TAGS + INVOKE_OPEN + PARAM_OPEN  # after "<｜DSML｜"
CLOSE_TAGS = BLOCK_TAGS + INVOKE_CLOSE + PARAM_CLOSE  # after "</｜DSML｜"; also what ends a value
QUOTE = '"'
NAME_ENDS = (">", "/>", " />")  # after an invoke name's closing quote; the last two: no parameters
SELF_CLOSING = NAME_ENDS[1:]
KEY_END = ' string="'  # after a parameter key's closing quote
KINDS = ('true">', 'false">')
WRAPPER = "arguments"


class _State(enum.Enum):
    BETWEEN = 0  # looking for the next tag
    OPEN_TAG = 1  # after "<｜DSML｜"
    CLOSE_TAG = 2  # after "</｜DSML｜"
    NAME = 3  # inside invoke name="...
    KEY = 4  # inside parameter name="...
    KIND = 5  # after '" string="'
    VALUE = 6  # inside a parameter value


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    fragments: list[str] = field(default_factory=list)  # arguments text, in order
    params: int = 0  # parameters written into the fragments
    started: int = 0  # parameters whose kind was read
    closed: bool = False
    truncated: bool = False  # closed by the end of generation, not by a tag (§7.10a)
    held: bool = False  # fragments not sent yet: the call may be a lone `arguments` wrapper

    @property
    def arguments(self) -> str:
        return "".join(self.fragments)


def declared_properties(tools: Iterable[Any] | None) -> dict[str, frozenset[str]]:
    """Tool name -> the property names its ``parameters`` schema declares, for the request's tools (OpenAI
    ``{"type": "function", "function": {...}}`` items or bare function objects) that declare them."""
    out: dict[str, frozenset[str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        if isinstance(fn.get("name"), str) and isinstance(props, Mapping):
            out[fn["name"]] = frozenset(props)
    return out


def unwrapped_arguments(arguments: str, properties: frozenset[str]) -> str:
    """``{"arguments": X}`` -> X's JSON text when X is an object (or strict JSON text of one) whose keys are
    all in ``properties``; else ``arguments`` unchanged."""
    try:
        inner = strict_loads(arguments).get(WRAPPER)
        if isinstance(inner, str):
            inner = strict_loads(inner)
    except (ValueError, AttributeError):
        return arguments
    if isinstance(inner, dict) and inner.keys() <= properties:
        return dumps(inner)
    return arguments


class DsmlParser:
    """Parses DSML blocks into tool calls. ``call_id``: index -> call id. ``properties``: tool name -> its
    declared parameter names (:func:`declared_properties`), for the ``arguments`` wrapper rule."""

    def __init__(self, call_id: Callable[[int], str], properties: Mapping[str, frozenset[str]] | None = None) -> None:
        self._call_id = call_id
        self._properties = properties or {}
        self.calls: list[_Call] = []
        self._state = _State.OPEN_TAG
        self._key = ""
        self._string = False
        self._raw: list[str] = []  # pending non-string value

    @property
    def state(self) -> object:
        """Opaque sub-state (the driver compares it to detect progress)."""
        return self._state

    @property
    def truncated(self) -> bool:
        """Whether the last call was cut off by the end of generation (§7.10a)."""
        return bool(self.calls) and self.calls[-1].truncated

    def begin(self) -> None:
        """A ``<｜DSML｜`` was just consumed."""
        self._state = _State.OPEN_TAG

    def step(self, buf: str, final: bool, out: Emitter) -> tuple[int, str | None]:
        """Consume a prefix of ``buf``. Returns ``(chars consumed, event)``; event ``"done"`` (block
        closed), ``"end"`` (EOS) or None. Makes progress (chars or state) unless it needs more text."""
        s = self._state
        if s is _State.BETWEEN:
            return self._between(buf, final)
        if s in (_State.OPEN_TAG, _State.CLOSE_TAG):
            return self._tag(buf, final, out)
        if s in (_State.NAME, _State.KEY):
            return self._name_or_key(buf, final, out)
        if s is _State.KIND:
            return self._kind(buf, final, out)
        return self._value(buf, final, out)

    def close(self, out: Emitter) -> None:
        """End of output: cut an open value and call (§7.10a)."""
        if self._state is _State.VALUE:
            self._end_value(out, complete=False)
        self._close_call(out, complete=False)
        self._state = _State.BETWEEN

    # ------------------------------------------------------------------ states

    def _between(self, buf: str, final: bool) -> tuple[int, str | None]:
        markers = (OPEN, CLOSE, EOS)
        hit = find_first(buf, markers)
        if hit is None:
            return (len(buf) if final else len(buf) - partial_tail(buf, markers)), None
        pos, marker = hit
        if marker == EOS:
            return pos + len(marker), "end"
        self._state = _State.OPEN_TAG if marker == OPEN else _State.CLOSE_TAG
        return pos + len(marker), None

    def _tag(self, buf: str, final: bool, out: Emitter) -> tuple[int, str | None]:
        """The tag name after ``<｜DSML｜`` (OPEN_TAG) or ``</｜DSML｜`` (CLOSE_TAG); an unknown one is skipped."""
        opening = self._state is _State.OPEN_TAG
        m = match_pattern(buf, OPEN_TAGS if opening else CLOSE_TAGS, final)
        if m is None:
            return 0, None
        self._state = _State.BETWEEN
        if m is False:
            return 0, None
        if opening:
            if m in INVOKE_OPEN:
                self._close_call(out)  # a new invoke ends the previous call, whatever its own tag holds
                self._state = _State.NAME
            elif m in PARAM_OPEN and self._open_call() is not None:
                self._state = _State.KEY
        elif m not in PARAM_CLOSE:  # an invoke or block closer
            self._close_call(out)
            if m in BLOCK_TAGS:
                return len(m), "done"
        return len(m), None

    def _name_or_key(self, buf: str, final: bool, out: Emitter) -> tuple[int, str | None]:
        """An invoke name or parameter key: the text to the first ``"``, then the rest of its own tag. A tag
        that breaks off first (another DSML tag, EOS, the end of the text) is dropped (§7.10a)."""
        naming = self._state is _State.NAME
        hit = find_first(buf, (QUOTE, OPEN, CLOSE, EOS))
        if hit is None:
            if final:
                self._state = _State.BETWEEN
                return len(buf), None
            return 0, None
        pos, marker = hit
        if marker != QUOTE:  # the tag broke off: the marker is read again as what it is
            self._state = _State.BETWEEN
            return pos, None
        rest = pos + len(QUOTE)
        m = match_pattern(buf[rest:], NAME_ENDS if naming else (KEY_END,), final)
        if m is None:
            return 0, None
        self._state = _State.BETWEEN
        if m is False:
            return rest, None
        if not naming:
            self._key = buf[:pos]
            self._state = _State.KIND
        elif pos:  # an empty name is no call
            self._start_call(buf[:pos], out)
            if m in SELF_CLOSING:
                self._close_call(out)
        return rest + len(m), None

    def _kind(self, buf: str, final: bool, out: Emitter) -> tuple[int, str | None]:
        m = match_pattern(buf, KINDS, final)
        if m is None:
            return 0, None
        if m is False:
            self._state = _State.BETWEEN  # malformed parameter: skipped
            return 0, None
        call = self._open_call()
        assert call is not None
        if call.held:  # a second parameter: not a lone wrapper
            self._release(call, out)
        elif call.started == 0 and self._key == WRAPPER:
            declared = self._properties.get(call.name)
            call.held = declared is not None and WRAPPER not in declared
        call.started += 1
        self._string = m == KINDS[0]
        if self._string:  # streams from here; a non-string parameter is written when it completes
            self._append_param(call, '"', out)
        self._raw = []
        self._state = _State.VALUE
        return len(m), None

    def _value(self, buf: str, final: bool, out: Emitter) -> tuple[int, str | None]:
        markers = (CLOSE, EOS)
        start = 0  # text before it is value text (no real closer, no EOS)
        while True:
            hit = find_first(buf[start:], markers)
            if hit is None:
                # A suffix that could start a marker never reaches back past `start` (a complete closer).
                end = len(buf) if final else len(buf) - partial_tail(buf, markers)
                self._value_text(buf[:end], out)
                return end, None
            pos, marker = start + hit[0], hit[1]
            if marker == CLOSE:
                tag = match_pattern(buf[pos + len(CLOSE) :], CLOSE_TAGS, final)
                if tag is False:  # "</｜DSML｜" not followed by a closing tag: value text
                    start = pos + len(CLOSE)
                    continue
                if tag is None:  # could still become a closing tag: wait for more text
                    self._value_text(buf[:pos], out)
                    return pos, None
            self._value_text(buf[:pos], out)
            if marker == EOS:  # generation ended inside the value: the driver closes the call
                self._state = _State.BETWEEN
                self._end_value(out, complete=False)
                return pos + len(marker), "end"
            self._end_value(out, complete=True)
            self._state = _State.CLOSE_TAG
            return pos + len(marker), None

    # ------------------------------------------------------------------ calls

    def _open_call(self) -> _Call | None:
        return self.calls[-1] if self.calls and not self.calls[-1].closed else None

    def _start_call(self, name: str, out: Emitter) -> None:
        index = len(self.calls)
        call = _Call(self._call_id(index), name)
        self.calls.append(call)
        out.call_fragment(index, "", call_id=call.id, name=name)

    def _append(self, call: _Call, text: str, out: Emitter) -> None:
        if text:
            call.fragments.append(text)
            if not call.held:
                out.call_fragment(len(self.calls) - 1, text)  # only the last call is ever open

    def _append_param(self, call: _Call, value_text: str, out: Emitter) -> None:
        """Write the current key and the start (or all) of its value."""
        prefix = ("{" if call.params == 0 else ", ") + dumps(self._key) + ": "
        call.params += 1
        self._append(call, prefix + value_text, out)

    def _release(self, call: _Call, out: Emitter) -> None:
        """Send a held call's arguments so far in one fragment; later fragments stream again."""
        call.held = False
        if call.fragments:
            out.call_fragment(len(self.calls) - 1, call.arguments)

    def _value_text(self, text: str, out: Emitter) -> None:
        if not text:
            return
        if self._string:
            call = self._open_call()
            assert call is not None
            self._append(call, dumps(text)[1:-1], out)
        else:
            self._raw.append(text)

    def _end_value(self, out: Emitter, complete: bool) -> None:
        """The value ends: at its closing tag (``complete``) or with the output (§7.10a)."""
        call = self._open_call()
        assert call is not None
        if self._string:
            self._append(call, '"', out)
        else:
            raw = "".join(self._raw)
            text = value_text(raw) if complete else cut_value_text(raw)
            if text is not None:
                self._append_param(call, text, out)
        self._raw = []

    def _close_call(self, out: Emitter, complete: bool = True) -> None:
        call = self._open_call()
        if call is None:
            return
        self._append(call, "}" if call.params else "{}", out)
        if call.held:
            call.fragments = [unwrapped_arguments(call.arguments, self._properties[call.name])]
            self._release(call, out)
        call.closed = True
        call.truncated = not complete
