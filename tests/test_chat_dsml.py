"""DSML tool-call conformance (issue 18; docs/model.md §7.6, §7.10, §7.10a): cases that the DeepSeek-V4 / V4.1
parser tests of vLLM, SGLang and the Shepherd Model Gateway exercise, on both tag spellings (V4.1 spaced, V4
unspaced). Every case is parsed whole (the non-streaming path) and fed in every split of
``chat_helpers.every_split`` (the streaming path); both must give the same result, the streamed deltas must
fold to it, and no DSML markup may reach reasoning, content or arguments.
"""

from __future__ import annotations

import pytest

from chat_helpers import EOS, make_parser, parse_every_way, strict_json, summary

REVISIONS = ["v41", "v4"]
_TAGS = {"v41": (" calls", " invoke", " parameter"), "v4": ("tool_calls", "invoke", "parameter")}


def param(key: str, value: str, string: bool = True, rev: str = "v41") -> str:
    p = _TAGS[rev][2]
    return f'<｜DSML｜{p} name="{key}" string="{"true" if string else "false"}">{value}</｜DSML｜{p}>\n'


def invoke(name: str, *params: str, rev: str = "v41") -> str:
    i = _TAGS[rev][1]
    return f'<｜DSML｜{i} name="{name}">\n' + "".join(params) + f"</｜DSML｜{i}>\n"


def block(*body: str, rev: str = "v41") -> str:
    b = _TAGS[rev][0]
    return f"\n\n<｜DSML｜{b}>\n" + "".join(body) + f"</｜DSML｜{b}>"


def spell(template: str, rev: str) -> str:
    """``template`` with ``{b}``/``{i}``/``{p}`` replaced by ``rev``'s block / invoke / parameter tag names."""
    b, i, p = _TAGS[rev]
    return template.format(b=b, i=i, p=p)


def calls(text: str, **kw) -> list[tuple[str, str]]:
    """The (name, arguments) of ``text``'s calls, after checking every split agrees; arguments must be strict
    JSON (issue 18 item 1)."""
    result = parse_every_way(text, **{"thinking": False, **kw})
    for _, args in summary(result)[2]:
        strict_json(args)
    return summary(result)[2]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "number"}}}}}
FLEX = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


# ----------------------------------------------------------------------------- 1. arguments are always JSON


@pytest.mark.parametrize("raw", ["1e999", "-1e999", "1E400", "[1e999]", '{"a": 1e999}', '{"a": [1, -1e999]}'])
@pytest.mark.parametrize("rev", REVISIONS)
def test_overflowing_number_stays_its_literal_text(raw, rev):
    text = block(invoke("f", param("x", raw, False, rev), param("y", "ok", rev=rev), rev=rev), rev=rev) + EOS
    [(name, args)] = calls(text, tools=[FLEX])
    assert name == "f" and strict_json(args) == {"x": raw, "y": "ok"}


@pytest.mark.parametrize("string", [False, True])
def test_overflowing_number_inside_an_arguments_wrapper_keeps_the_wrapper(string):
    inner = '{"city": "Paris", "days": 1e999}'
    text = block(invoke("get_weather", param("arguments", inner, string))) + EOS
    [(_, args)] = calls(text, tools=[WEATHER])
    assert strict_json(args) == {"arguments": inner}


def test_finite_numbers_and_nan_keep_their_rules():
    text = block(invoke("f", param("a", "1e308", False), param("b", "-0.5", False), param("c", "NaN", False))) + EOS
    [(_, args)] = calls(text, tools=[FLEX])
    assert strict_json(args) == {"a": 1e308, "b": -0.5, "c": "NaN"}


# ----------------------------------------------------------------------------- 2. zero-argument calls


@pytest.mark.parametrize("closer", ["/>", " />"])
@pytest.mark.parametrize("rev", REVISIONS)
def test_self_closing_invoke_is_a_call_without_arguments(closer, rev):
    text = spell('Refreshing.\n\n<｜DSML｜{b}>\n<｜DSML｜{i} name="refresh"' + closer + "\n", rev)
    text += invoke("search", param("q", "x", rev=rev), rev=rev) + spell("</｜DSML｜{b}>", rev) + "Done." + EOS
    result = parse_every_way(text, thinking=False)
    assert summary(result) == (None, "Refreshing.Done.", [("refresh", "{}"), ("search", '{"q": "x"}')])
    assert result.finish_reason() == "tool_calls"


@pytest.mark.parametrize("rev", REVISIONS)
def test_self_closing_invoke_alone_and_last(rev):
    text = spell('\n\n<｜DSML｜{b}>\n<｜DSML｜{i} name="refresh"/>\n</｜DSML｜{b}>', rev) + EOS
    assert calls(text) == [("refresh", "{}")]
    cut = spell('\n\n<｜DSML｜{b}>\n<｜DSML｜{i} name="refresh"/>', rev)  # generation ends right after it
    result = parse_every_way(cut, thinking=False)
    assert summary(result)[2] == [("refresh", "{}")] and result.finish_reason() == "tool_calls"


# ----------------------------------------------------------------------------- 3. empty names


@pytest.mark.parametrize("rev", REVISIONS)
def test_invoke_with_an_empty_name_is_dropped_and_later_calls_parse(rev):
    empty = invoke("", param("a", "1", rev=rev), rev=rev)
    text = "Hi." + block(empty, invoke("search", param("q", "x", rev=rev), rev=rev), rev=rev) + EOS
    result = parse_every_way(text, thinking=False)
    assert summary(result) == (None, "Hi.", [("search", '{"q": "x"}')])
    self_closed = spell('\n\n<｜DSML｜{b}>\n<｜DSML｜{i} name=""/>\n', rev)
    text = self_closed + invoke("bash", rev=rev) + spell("</｜DSML｜{b}>", rev) + EOS
    assert calls(text) == [("bash", "{}")]


# ----------------------------------------------------------------------------- 4. malformed parameters


MALFORMED = [
    '<｜DSML｜{p} name="bad">1</｜DSML｜{p}>\n',  # no string="..."
    '<｜DSML｜{p} name="bad" type="int">1</｜DSML｜{p}>\n',
    '<｜DSML｜{p} name="bad" string="yes">1</｜DSML｜{p}>\n',
    '<｜DSML｜{p} name="bad\n',  # the name never closes before the next tag
    '<｜DSML｜{p} name=bad>1</｜DSML｜{p}>\n',
]


@pytest.mark.parametrize("bad", MALFORMED)
@pytest.mark.parametrize("rev", REVISIONS)
def test_malformed_parameter_does_not_corrupt_its_neighbours(bad, rev):
    body = param("before", "x", rev=rev) + spell(bad, rev) + param("after", "2", False, rev)
    assert calls(block(invoke("f", body, rev=rev), rev=rev) + EOS) == [("f", '{"before": "x", "after": 2}')]


@pytest.mark.parametrize("bad", ['<｜DSML｜{i} name="g\n', '<｜DSML｜{i} name="g" x>\n',
                                 "<｜DSML｜{i} name=g>\n"])
@pytest.mark.parametrize("rev", REVISIONS)
def test_malformed_invoke_tag_does_not_swallow_its_neighbours(bad, rev):
    orphan = param("lost", "1", rev=rev) + spell("</｜DSML｜{i}>\n", rev)
    body = invoke("a", rev=rev) + spell(bad, rev) + orphan + invoke("b", param("k", "v", rev=rev), rev=rev)
    assert calls(block(body, rev=rev) + EOS) == [("a", "{}"), ("b", '{"k": "v"}')]


# ----------------------------------------------------------------------------- 5. stray closing tags


@pytest.mark.parametrize("tag", [" calls", "tool_calls", "function_calls", " invoke", "invoke", " parameter",
                                 "parameter"])
def test_stray_dsml_closing_tag_never_reaches_the_user(tag):
    stray = f"</｜DSML｜{tag}>"
    result = parse_every_way(f"Hello{stray} world{stray}" + EOS, thinking=False)
    assert summary(result) == (None, "Hello world", [])
    result = parse_every_way(f"Think{stray}ing</think>Answer{stray}" + EOS, thinking=True)
    assert summary(result) == ("Thinking", "Answer", [])
    after = block(invoke("bash")) + f"Done.{stray}" + EOS
    assert summary(parse_every_way(after, thinking=False)) == (None, "Done.", [("bash", "{}")])


def test_lone_dsml_closing_marker_is_dropped_and_the_rest_kept():
    result = parse_every_way("a</｜DSML｜ nonsense> b</｜DSML｜" + EOS, thinking=False)
    assert summary(result) == (None, "a nonsense> b", [])


# ----------------------------------------------------------------------------- 7. truncated calls


def cut_call(rev: str, tail: str) -> str:
    """A block whose call ``f`` has one complete string parameter, then ``tail`` where generation ended."""
    return block(rev=rev)[: -len(spell("</｜DSML｜{b}>", rev))] + spell('<｜DSML｜{i} name="f">\n', rev) + \
        param("s", "x", rev=rev) + tail


@pytest.mark.parametrize("raw", ["[1, 2", '{"a": 1', "12", "-", "1e5", "tru", "NaN", '"unclosed'])
@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("rev", REVISIONS)
def test_truncated_non_string_parameter_is_dropped_never_retyped(raw, eos, rev):
    text = cut_call(rev, spell('<｜DSML｜{p} name="n" string="false">', rev) + raw) + (EOS if eos else "")
    result = parse_every_way(text, thinking=False, tools=[FLEX])
    assert summary(result)[2] == [("f", '{"s": "x"}')]
    assert result.truncated_call
    assert result.finish_reason("stop") == "stop" and result.finish_reason("length") == "length"


@pytest.mark.parametrize("raw", ["[1, 2]", '{"a": 1}', '"text"', "true", "null"])
def test_truncated_parameter_whose_text_is_a_whole_json_value_is_kept(raw):
    text = cut_call("v41", '<｜DSML｜ parameter name="n" string="false">' + raw)
    result = parse_every_way(text, thinking=False, tools=[FLEX])
    assert strict_json(summary(result)[2][0][1]) == {"s": "x", "n": strict_json(raw)}
    assert result.truncated_call and result.finish_reason("stop") == "stop"


@pytest.mark.parametrize("value", ["hel", ""])
def test_truncated_string_parameter_keeps_its_declared_type(value):
    result = parse_every_way(cut_call("v41", '<｜DSML｜ parameter name="q" string="true">' + value), thinking=False)
    assert [(n, strict_json(a)) for n, a in summary(result)[2]] == [("f", {"s": "x", "q": value})]
    assert result.truncated_call


def test_call_cut_between_parameters_is_incomplete_and_closed_calls_are_not():
    text = cut_call("v41", "")
    result = parse_every_way(text, thinking=False)
    assert summary(result)[2] == [("f", '{"s": "x"}')] and result.truncated_call
    whole = block(invoke("f", param("s", "x")))[: -len("</｜DSML｜ calls>")]  # only the block closer is missing
    result = parse_every_way(whole, thinking=False)
    assert not result.truncated_call and result.finish_reason("stop") == "tool_calls"


def test_non_string_parameter_is_emitted_only_when_complete():
    text = block(invoke("f", param("s", "ab"), param("n", "12345", False), param("t", "cd"))) + EOS
    closed_at = text.index("12345</｜DSML｜ parameter>") + len("12345</｜DSML｜ parameter>")
    parser = make_parser(thinking=False)
    emitted = ""
    for k, ch in enumerate(text):
        delta = parser.feed_text(ch)
        emitted += "".join(t.arguments for t in delta.tool_call_deltas)
        if k + 1 < closed_at:
            assert '"n"' not in emitted and "1" not in emitted, (k, emitted)
    assert strict_json(emitted) == {"s": "ab", "n": 12345, "t": "cd"}
