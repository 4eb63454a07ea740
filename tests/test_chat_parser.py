"""Tests for ``v41.chat.OutputParser`` (docs/model.md §7.6, §7.10; KF-01..KF-04).

Model outputs are produced by the encoder's own rendering of an assistant turn (the suffix of the prompt
that contains the turn, after the generation prompt), so what is parsed is exactly what the model was
trained to write. The central property: for any split of the output into ``feed`` calls (every character
or token split, random splits, everything at once) the result is the same, and the streamed deltas
concatenate to it.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chat_helpers import (
    EOS,
    TOK,
    TOOLS,
    check_stream,
    make_parser,
    random_chunks,
    run,
    splits_of,
    strict_json,
    summary,
)
from v41.chat import OutputParser, ParserResult, ToolCallDelta, encode_messages, render_messages

MARKER_TEXTS = ("｜DSML｜", "<think>", "</think>", EOS, "<｜DSML", "</｜DSML")


# ----------------------------------------------------------------------------- helpers


def rendered_turn(reasoning, content, calls, thinking=True, revision="v41", tools=TOOLS):
    """(prompt_ids, generated_ids, generated_text) of an assistant turn as the encoder renders it."""
    user = [{"role": "user", "content": "Q"}]
    tool_calls = [
        {"id": f"h{k}", "type": "function", "function": {"name": name, "arguments": args}}
        for k, (name, args) in enumerate(calls)
    ]
    turn = {"role": "assistant", "reasoning_content": reasoning, "content": content, "tool_calls": tool_calls}
    kw = dict(tools=tools, thinking=thinking, revision=revision)
    prompt_ids = encode_messages(TOK, user, **kw)
    full_ids = encode_messages(TOK, user + [turn], **kw)
    assert full_ids[: len(prompt_ids)] == prompt_ids
    prompt_text = render_messages(user, **kw)
    full_text = render_messages(user + [turn], **kw)
    assert full_text.startswith(prompt_text)
    return prompt_ids, full_ids[len(prompt_ids) :], full_text[len(prompt_text) :]


def expected(reasoning, content, calls, thinking=True):
    return (
        (reasoning or None) if thinking else None,
        content,
        [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls],
    )


def assert_split_invariant(prompt_ids, gen_ids, gen_text, want, **kw):
    rng = random.Random(0)
    base, _ = run([gen_text], by_ids=False, prompt_ids=prompt_ids, **kw)
    assert summary(base) == want
    for chunks in splits_of(gen_text, rng, 20):
        result, deltas = run(chunks, by_ids=False, prompt_ids=prompt_ids, **kw)
        assert result == base
        check_stream(result, deltas)
    for chunks in splits_of(gen_ids, rng, 20):
        result, deltas = run(chunks, by_ids=True, prompt_ids=prompt_ids, **kw)
        assert result == base
        check_stream(result, deltas)
    return base


# ----------------------------------------------------------------------------- split invariance

TRICKY = 'a "b" \\c\n<x> </think> <｜User｜> 北京 😀 </ ｜DSML ＞'
CASES = {
    "answer_with_reasoning": ("Let me think.\n\nIt is 4.", "The answer is **4**.\n", [], True),
    "answer_chat_mode": ("", "Hi there!\n\nBye.\n\n", [], False),
    "empty_reasoning_and_content": ("", "", [], True),
    "one_call_with_reasoning": (
        "I should call get_weather.",
        "",
        [("get_weather", {"city": "Paris", "days": 2})],
        True,
    ),
    "three_calls_content_first": (
        "",
        "Checking three things.\n",
        [
            ("get_weather", {"city": "東京", "days": 1.5, "opts": {"units": ["C", None, True]}}),
            ("search", {"query": TRICKY, "n": -3}),
            ("bash", {}),
        ],
        True,
    ),
    "three_calls_chat_mode": (
        "",
        "",
        [("search", {"query": "x"}), ("search", {"query": ""}), ("bash", {"command": "ls -la /var/log 2>&1"})],
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("revision", ["v41", "v4-original"])
def test_every_split_gives_the_same_result(name, revision):
    reasoning, content, calls, thinking = CASES[name]
    prompt_ids, gen_ids, gen_text = rendered_turn(reasoning, content, calls, thinking, revision)
    assert_split_invariant(
        prompt_ids, gen_ids, gen_text, expected(reasoning, content, calls, thinking), revision=revision
    )


# ----------------------------------------------------------------------------- known failures


def test_kf01_whole_block_in_one_delta():
    calls = [("get_weather", {"location": "Tokyo"}), ("search", {"query": "Tokyo travel guide"})]
    prompt_ids, gen_ids, gen_text = rendered_turn("", "", calls, thinking=False)
    block = gen_text[: gen_text.index(EOS)]
    parser = make_parser(prompt_ids=prompt_ids)
    delta = parser.feed_text(block)
    assert [(t.index, t.id, t.name, t.arguments) for t in delta.tool_call_deltas] == [
        (0, "call_0", "get_weather", '{"location": "Tokyo"}'),
        (1, "call_1", "search", '{"query": "Tokyo travel guide"}'),
    ]
    result = parser.finish()
    assert [c["function"]["arguments"] for c in result.tool_calls] == [
        '{"location": "Tokyo"}',
        '{"query": "Tokyo travel guide"}',
    ]
    assert result.finish_reason() == "tool_calls" and result.finish_reason("length") == "length"
    one_shot, _ = run([gen_ids], by_ids=True, prompt_ids=prompt_ids)
    assert one_shot == result
    assert_split_invariant(prompt_ids, gen_ids, gen_text, expected("", "", calls, thinking=False))


@pytest.mark.parametrize("value", ["ls -la /var/log 2>&1", "北京", 'a "b" \\c'])
def test_kf02_parameter_closer_never_leaks_into_arguments(value):
    prompt_ids, gen_ids, gen_text = rendered_turn("Run it.", "", [("bash", {"command": value})])
    want_args = json.dumps({"command": value}, ensure_ascii=False)
    assert "\\u" not in want_args
    for i in range(len(gen_text) + 1):
        result, deltas = run([gen_text[:i], gen_text[i:]], by_ids=False, prompt_ids=prompt_ids)
        assert result.tool_calls[0]["function"]["arguments"] == want_args
        assert result.content == "" and result.reasoning_content == "Run it."
        check_stream(result, deltas)
    assert_split_invariant(prompt_ids, gen_ids, gen_text, expected("Run it.", "", [("bash", {"command": value})]))


def test_kf03_answer_without_think_close_is_content():
    prompt_ids = encode_messages(TOK, [{"role": "user", "content": "Good morning"}])  # thinking on: ends in <think>
    answer = "Good morning! How can I help you today?"
    text = answer + EOS
    ids = TOK.encode(answer, add_special_tokens=False).ids + [TOK.token_to_id(EOS)]
    for by_ids, seq in ((False, text), (True, ids)):
        for chunks in splits_of(seq, random.Random(1), 10):
            result, deltas = run(chunks, by_ids=by_ids, prompt_ids=prompt_ids, tools=None)
            assert (result.reasoning_content, result.content, result.tool_calls) == (None, answer, [])
            check_stream(result, deltas)
    # Without EOS (e.g. stopped by max_tokens) the policy is the same.
    result, _ = run([answer], by_ids=False, thinking=True)
    assert (result.reasoning_content, result.content) == (None, answer)


def test_kf03_long_unterminated_reasoning_stays_reasoning_unless_holdback_is_unbounded():
    long = "step " * 100  # 500 chars > the default 256-char hold-back
    result, deltas = run([long[:10], long[10:]], by_ids=False, thinking=True)
    assert (result.reasoning_content, result.content) == (long, "")
    assert deltas[1].reasoning_delta  # streamed before the end
    result, deltas = run([long], by_ids=False, thinking=True, reasoning_holdback_chars=None)
    assert (result.reasoning_content, result.content) == (None, long)
    assert not deltas[0].reasoning_delta and not deltas[0].content_delta
    closed, _ = run(["short", "</think>answer"], by_ids=False, thinking=True)
    assert (closed.reasoning_content, closed.content) == ("short", "answer")


def test_kf04_thinking_off_gives_content_only():
    for kw in (
        {"thinking": False},
        {"thinking": True, "prompt_ids": encode_messages(TOK, [{"role": "user", "content": "hello"}], thinking=False)},
    ):
        result, deltas = run(["Hello! ", "How can I help?", EOS], by_ids=False, tools=None, **kw)
        assert (result.reasoning_content, result.content, result.tool_calls) == (None, "Hello! How can I help?", [])
        check_stream(result, deltas)
    # Server default (thinking=None) is thinking on.
    result, _ = run(["r</think>c"], by_ids=False)
    assert (result.reasoning_content, result.content) == ("r", "c")


# ----------------------------------------------------------------------------- start state


def test_start_state_follows_the_prompt_end():
    user = [{"role": "user", "content": "Q"}]
    think_prompt = encode_messages(TOK, user, thinking=True)
    chat_prompt = encode_messages(TOK, user, thinking=False)
    text = "r</think>c"
    assert summary(run([text], False, prompt_ids=think_prompt, thinking=False)[0])[:2] == ("r", "c")
    assert summary(run([text], False, prompt_ids=chat_prompt, thinking=True)[0])[:2] == (None, "rc")
    action = encode_messages(TOK, [{"role": "user", "content": "Q", "task": "action"}], thinking=True)
    assert TOK.decode(action[-3:], skip_special_tokens=False) == "<｜Assistant｜><think><｜action｜>"
    assert summary(run(["Search"], False, prompt_ids=action, thinking=True)[0])[:2] == (None, "Search")
    # Continuing inside the reasoning (prompt ends "<think>partial") and after it ("</think>partial").
    in_reasoning = encode_messages(
        TOK, user + [{"role": "assistant", "reasoning_content": "Hmm, "}], continue_final_message=True
    )
    assert TOK.decode(in_reasoning, skip_special_tokens=False).endswith("<｜Assistant｜><think>Hmm, ")
    assert summary(run(["more</think>done"], False, prompt_ids=in_reasoning)[0])[:2] == ("more", "done")
    in_content = encode_messages(
        TOK, user + [{"role": "assistant", "reasoning_content": "R", "content": "Par"}], continue_final_message=True
    )
    assert summary(run(["tial", EOS], False, prompt_ids=in_content)[0])[:2] == (None, "tial")
    # A prompt with no thinking marker after its last turn boundary falls back to the flag.
    raw = TOK.encode("<｜User｜>plain", add_special_tokens=False).ids
    assert summary(run(["x"], False, prompt_ids=raw, thinking=False)[0])[:2] == (None, "x")


# ----------------------------------------------------------------------------- EOS, markers, leniency


def test_eos_ends_output_and_never_appears():
    result, deltas = run(["answer", EOS, "garbage after EOS"], by_ids=False, thinking=False)
    assert (result.content, result.reasoning_content) == ("answer", None)
    result, _ = run(
        [[TOK.token_to_id(EOS)], TOK.encode("late", add_special_tokens=False).ids], by_ids=True, thinking=False
    )
    assert result.content == ""
    # EOS inside a string value closes the call with what it has (valid JSON).
    text = (
        '</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="bash">\n'
        '<｜DSML｜ parameter name="command" string="true">ls -l' + EOS
    )
    result, deltas = run([text], by_ids=False, thinking=True)
    assert json.loads(result.tool_calls[0]["function"]["arguments"]) == {"command": "ls -l"}
    check_stream(result, deltas)


def test_truncated_output_closes_open_call_and_drops_partial_names():
    head = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="search">\n<｜DSML｜ parameter name="query" string="true">tok'
    result, deltas = run([head], by_ids=False, thinking=False)
    assert summary(result) == (None, "", [("search", '{"query": "tok"}')])
    check_stream(result, deltas)
    partial_name = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="sea'
    assert run([partial_name], by_ids=False, thinking=False)[0].tool_calls == []
    # A cut non-string value is dropped, never turned into a string (docs/model.md §7.10a).
    non_string = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="n" string="false">[1, 2'
    cut = run([non_string], by_ids=False, thinking=False)[0]
    assert summary(cut)[2] == [("f", "{}")] and cut.truncated_call


def test_tool_block_inside_reasoning_ends_it_implicitly():
    text = 'thinking...\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="bash">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>' + EOS
    for chunks in splits_of(text, random.Random(2), 5):
        result, deltas = run(chunks, by_ids=False, thinking=True)
        assert summary(result) == ("thinking...", "", [("bash", "{}")])
        check_stream(result, deltas)


def test_non_string_values_are_json_decoded_with_raw_fallback():
    text = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="a" string="false">{"k":[1,2.50,"\\u5317"]}</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="b" string="false">not json</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="c" string="false">NaN</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="d" string="true">  spaced\n</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )
    result, _ = run([text], by_ids=False, thinking=False)
    args = result.tool_calls[0]["function"]["arguments"]
    assert args == '{"a": {"k": [1, 2.5, "北"]}, "b": "not json", "c": "NaN", "d": "  spaced\\n"}'


def test_v4_and_lenient_tag_spellings_parse():
    for block, invoke, param in (
        ("tool_calls", "invoke", "parameter"),
        ("function_calls", "invoke", "parameter"),
        (" calls", " invoke", " parameter"),
    ):
        text = (
            f'\n\n<｜DSML｜{block}>\n<｜DSML｜{invoke} name="search">\n'
            f'<｜DSML｜{param} name="query" string="true">x</｜DSML｜{param}>\n</｜DSML｜{invoke}>\n</｜DSML｜{block}>'
        )
        assert summary(run([text], by_ids=False, thinking=False)[0]) == (None, "", [("search", '{"query": "x"}')])


def test_text_after_block_is_content_and_second_block_adds_calls():
    one = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="a">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    two = one.replace('"a"', '"b"')
    result, deltas = run(["pre\n\n" + one + "mid\n\n" + two + EOS], by_ids=False, thinking=False)
    assert summary(result) == (None, "premid", [("a", "{}"), ("b", "{}")])
    check_stream(result, deltas)


def test_without_tools_dsml_text_stays_content():
    text = '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="a">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    result, _ = run([text + EOS], by_ids=False, thinking=False, tools=None)
    assert (result.content, result.tool_calls) == (text, [])


def test_stray_think_markers_are_dropped():
    result, deltas = run(["<think>r1", "</think>c1</think><think>c2"], by_ids=False, thinking=True)
    assert (result.reasoning_content, result.content) == ("r1", "c1c2")
    check_stream(result, deltas)


def test_malformed_tags_are_skipped():
    text = (
        "<｜DSML｜ calls>\nnoise<｜DSML｜ bogus>\n"
        '<｜DSML｜ parameter name="orphan" string="true">v</｜DSML｜ parameter>\n'
        '<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="k" string="maybe">v</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="ok" string="true">1</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    )
    for chunks in splits_of(text, random.Random(3), 5):
        result, deltas = run(chunks, by_ids=False, thinking=False)
        assert summary(result) == (None, "", [("f", '{"ok": "1"}')])
        check_stream(result, deltas)


def test_long_string_argument_streams_before_it_closes():
    value = "".join(f"line {i}: some text, more text\n" for i in range(30))
    prompt_ids, gen_ids, gen_text = rendered_turn("", "", [("bash", {"command": value})], thinking=False)
    parser = make_parser(prompt_ids=prompt_ids)
    close_at = gen_text.index("</｜DSML｜ parameter>")
    fragments = 0
    for k in range(len(gen_ids)):
        if len(TOK.decode(gen_ids[: k + 1], skip_special_tokens=False)) >= close_at:
            break
        delta = parser.feed(gen_ids[k : k + 1])
        fragments += sum(1 for t in delta.tool_call_deltas if t.arguments and t.id is None)
    assert fragments > 20
    parser.feed(gen_ids[k:])
    assert json.loads(parser.finish().tool_calls[0]["function"]["arguments"]) == {"command": value}


def test_tool_call_delta_openai_shapes():
    first = ToolCallDelta(0, "call_x", "f", "")
    assert first.to_openai() == {
        "index": 0,
        "id": "call_x",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert ToolCallDelta(0, arguments='{"a"').to_openai() == {"index": 0, "function": {"arguments": '{"a"'}}


def test_default_call_ids_are_unique_openai_style():
    text = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="a">\n</｜DSML｜ invoke>\n'
        '<｜DSML｜ invoke name="b">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    )
    p = OutputParser(TOK, thinking=False, tools=TOOLS)
    p.feed_text(text)
    ids = [c["id"] for c in p.finish().tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_parser_misuse_raises():
    p = make_parser(thinking=False)
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed_text("x")
    text_only = OutputParser(None, thinking=False, tools=TOOLS)
    with pytest.raises(RuntimeError):
        text_only.feed([1])
    assert text_only.feed_text("hi").content_delta == "hi"
    with pytest.raises(ValueError):
        OutputParser(None, prompt_ids=[1, 2])


# ----------------------------------------------------------------------------- property test

_FRAGMENTS = [
    "<", ">", '"', "\\", "\n", "\n\n", "/", "</", "<｜", "｜", "▁", '{"a": 1}', "</think>", "<think>", "<｜User｜>",
    "｜DSML｜", "<｜DSML｜ invoke", "北京", "😀", ' string="', '">', "\u2028", "\t", "\x00", "null", "é",
]  # fmt: skip
_FORBIDDEN_EVERYWHERE = ("</｜DSML｜", EOS)
_text = (
    st.lists(st.one_of(st.characters(blacklist_categories=("Cs",)), st.sampled_from(_FRAGMENTS)), max_size=12)
    .map("".join)
    .filter(lambda s: not any(f in s for f in _FORBIDDEN_EVERYWHERE))
)
# Names and keys cannot hold a quote or DSML markup: the format has no escaping (docs/model.md §7.10a).
_names = _text.filter(lambda s: s and '"' not in s and "<｜DSML｜" not in s)
_keys = _text.filter(lambda s: '"' not in s and "<｜DSML｜" not in s)
_free_text = _text.filter(lambda s: not any(m in s for m in ("<think>", "</think>", "<｜DSML｜")))
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_text, children, max_size=3),
    max_leaves=8,
)
_calls = st.lists(st.tuples(_names, st.dictionaries(_keys, _json, max_size=4)), max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(
    reasoning=_free_text,
    content=_free_text,
    calls=_calls,
    thinking=st.booleans(),
    revision=st.sampled_from(["v41", "v4-original"]),
    data=st.data(),
)
def test_random_tool_calls_round_trip_through_render_and_parse(reasoning, content, calls, thinking, revision, data):
    prompt_ids, gen_ids, gen_text = rendered_turn(reasoning, content, calls, thinking, revision)
    want = expected(reasoning, content, calls, thinking)
    kw = dict(prompt_ids=prompt_ids, revision=revision)
    whole, _ = run([gen_ids], by_ids=True, **kw)
    assert summary(whole) == want
    for seq, by_ids in ((gen_ids, True), (gen_text, False)):
        cuts = sorted(set(data.draw(st.lists(st.integers(0, len(seq)), max_size=10))))
        bounds = [0, *cuts, len(seq)]
        result, deltas = run([seq[a:b] for a, b in zip(bounds, bounds[1:])], by_ids=by_ids, **kw)
        assert result == whole
        check_stream(result, deltas, markers_in_data=True)


_SOUP = [
    "<｜DSML｜", "</｜DSML｜", " calls>", "tool_calls>", " invoke", ' name="', "f", '">', " parameter", '" string="',
    'true">', 'false">', ">", "\n", "\n\n", "<think>", "</think>", EOS, "[1, 2]", "x", " ", '"', "北", "<", "</",
    "1e999", "/>",
]  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(st.sampled_from(_SOUP), max_size=40),
    thinking=st.booleans(),
    tools=st.booleans(),
    holdback=st.sampled_from([0, 5, 256, None]),
    data=st.data(),
)
def test_any_text_gives_the_same_result_for_any_split(pieces, thinking, tools, holdback, data):
    text = "".join(pieces)
    kw = dict(thinking=thinking, tools=TOOLS if tools else None, reasoning_holdback_chars=holdback)
    whole, _ = run([text], by_ids=False, **kw)
    for chunks in ([text[i : i + 1] for i in range(len(text))], None):
        if chunks is None:
            cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
            bounds = [0, *cuts, len(text)]
            chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        result, deltas = run(chunks, by_ids=False, **kw)
        assert result == whole
        check_stream(result, deltas, markers_in_data=True)
        assert EOS not in (result.reasoning_content or "") + result.content
        for c in result.tool_calls:
            strict_json(c["function"]["arguments"])  # issue 18 item 1: never NaN / Infinity


def test_feed_engine_output_drops_the_stop_token_keeps_stop_strings_and_counts_reasoning():
    prompt_ids, gen_ids, _ = rendered_turn("think hard", "the answer", [])
    close = TOK.token_to_id("</think>")
    assert close in gen_ids
    body = [t for t in gen_ids if t != TOK.token_to_id(EOS)]  # what the model wrote before its EOS
    want = OutputParser(TOK, prompt_ids=prompt_ids)
    for t in body:
        want.feed([t])
    want = want.finish()

    def run(finish_stop_reason, last):
        p = OutputParser(TOK, prompt_ids=prompt_ids)
        deltas, result = p.feed_engine_output(body[:3], None, None)
        assert result is None
        more, result = p.feed_engine_output(body[3:] + last, "stop", finish_stop_reason)
        return p, deltas + more, result

    # EOS / stop token id (stop_reason None or an int): that token is no text.
    for stop_reason in (None, 7):
        p, deltas, result = run(stop_reason, [7])
        assert summary(result) == summary(want) and result.final_delta is deltas[-1]
        assert p.reasoning_tokens(body + [7], result) == body.index(close)
    # A stop string: the tokens holding it were already text and are kept.
    _, _, kept = run("the", TOK.encode(" more", add_special_tokens=False).ids)
    assert kept.content.endswith("more")
    assert OutputParser(TOK, thinking=False).reasoning_tokens(body, ParserResult(None, "x", [])) == 0


# ----------------------------------------------------------------------------- issue 13: partial closers, wrappers


def assert_same_streamed_and_whole(text: str, want_calls, **kw):
    """Non-streaming (one feed) and streaming (small random chunks, many seeds) both give ``want_calls``."""
    whole, deltas = run([text], by_ids=False, **kw)
    assert summary(whole)[2] == want_calls
    check_stream(whole, deltas, markers_in_data=True)
    for seed in range(40):
        result, deltas = run(random_chunks(text, random.Random(seed)), by_ids=False, **kw)
        assert result == whole
        check_stream(result, deltas, markers_in_data=True)


def dsml_call(name: str, *params: tuple[str, bool, str]) -> str:
    """A V4.1 DSML block with one call; ``params``: (key, is_string, raw value text)."""
    body = "".join(
        f'<｜DSML｜ parameter name="{k}" string="{"true" if s else "false"}">{v}</｜DSML｜ parameter>\n'
        for k, s, v in params
    )
    return f'\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="{name}">\n{body}</｜DSML｜ invoke>\n</｜DSML｜ calls>' + EOS


@pytest.mark.parametrize(
    "value",
    [
        "x</｜DSML｜ paramete y",
        "x</｜DSML｜ y",
        "a</｜DSML｜b</｜DSML｜ invok",
        "</｜DSML｜",
        "x</｜DSML｜ parameter y",
        "x</｜DSML｜parameter name",
        "x </｜DSML｜ calls",
    ],
)
def test_partial_dsml_closer_inside_a_string_value_is_kept(value):
    text = dsml_call("bash", ("command", True, value), ("n", False, "1"))
    want = [("bash", json.dumps({"command": value, "n": 1}, ensure_ascii=False))]
    assert_same_streamed_and_whole(text, want, thinking=False)


def test_partial_dsml_closer_inside_a_non_string_value_is_kept():
    text = dsml_call("f", ("a", False, "[1]</｜DSML｜ param"), ("b", True, "z"))
    want = [("f", json.dumps({"a": "[1]</｜DSML｜ param", "b": "z"}, ensure_ascii=False))]
    assert_same_streamed_and_whole(text, want, thinking=False)


def test_partial_dsml_closer_at_the_end_of_a_truncated_value_is_kept():
    head = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="bash">\n<｜DSML｜ parameter name="command" string="true">ls</｜DSML｜ par'
    for chunks in ([head], random_chunks(head, random.Random(5))):
        result, deltas = run(chunks, by_ids=False, thinking=False)
        assert summary(result)[2] == [("bash", json.dumps({"command": "ls</｜DSML｜ par"}, ensure_ascii=False))]
        check_stream(result, deltas, markers_in_data=True)


def test_real_closers_still_end_a_value():
    # An invoke or block closer right after a value (no parameter closer) ends the value and the call.
    text = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">v</｜DSML｜ invoke>\n'
        '<｜DSML｜ invoke name="g">\n<｜DSML｜ parameter name="b" string="true">w</｜DSML｜ calls>after'
    )
    assert_same_streamed_and_whole(text, [("f", '{"a": "v"}'), ("g", '{"b": "w"}')], thinking=False)


def _tool(name: str, parameters=None) -> dict:
    fn = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": fn}


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
WRAPPER_TOOLS = [
    _tool("get_weather", WEATHER_SCHEMA),
    _tool("run", {"type": "object", "properties": {"arguments": {"type": "object"}, "cwd": {"type": "string"}}}),
    _tool("untyped", {"type": "object"}),
    _tool("bare"),
]


@pytest.mark.parametrize(
    "params, want",
    [
        ([("arguments", False, '{"city": "Paris", "days": 2}')], {"city": "Paris", "days": 2}),
        ([("arguments", False, '{"city":"北京"}')], {"city": "北京"}),
        ([("arguments", True, '{"city": "Paris"}')], {"city": "Paris"}),
        ([("arguments", False, "{}")], {}),
    ],
)
def test_arguments_wrapper_is_unwrapped_when_the_schema_lacks_it(params, want):
    text = dsml_call("get_weather", *params)
    want_calls = [("get_weather", json.dumps(want, ensure_ascii=False))]
    assert_same_streamed_and_whole(text, want_calls, thinking=False, tools=WRAPPER_TOOLS)


@pytest.mark.parametrize(
    "name, params",
    [
        ("run", [("arguments", False, '{"cwd": "/"}')]),  # the schema declares `arguments`
        ("untyped", [("arguments", False, '{"city": "Paris"}')]),  # no declared properties: schema unknown
        ("bare", [("arguments", False, '{"city": "Paris"}')]),  # no parameters schema
        ("unlisted", [("arguments", False, '{"city": "Paris"}')]),  # not a requested tool
        ("get_weather", [("arguments", False, '{"city": "Paris", "hourly": true}')]),  # undeclared inner key
        ("get_weather", [("arguments", False, '{"city": "Paris"}'), ("days", False, "2")]),  # not the whole value
        ("get_weather", [("days", False, "2"), ("arguments", False, '{"city": "Paris"}')]),
        ("get_weather", [("arguments", False, '["Paris"]')]),  # not an object
        ("get_weather", [("arguments", True, "Paris")]),
    ],
)
def test_arguments_wrapper_is_kept_otherwise(name, params):
    args = {k: (v if s else json.loads(v)) for k, s, v in params}
    text = dsml_call(name, *params)
    want_calls = [(name, json.dumps(args, ensure_ascii=False))]
    assert_same_streamed_and_whole(text, want_calls, thinking=False, tools=WRAPPER_TOOLS)


def test_arguments_wrapper_written_by_the_v4_reference_is_unwrapped_for_any_split():
    # The V4 reference encoder renders an object `arguments` as one wrapper parameter; a model trained on
    # such histories writes it back. Rendered here from the arguments {"arguments": {...}}.
    calls = [("get_weather", {"arguments": {"city": "Paris", "days": 3}}), ("get_weather", {"city": "Rome"})]
    prompt_ids, gen_ids, gen_text = rendered_turn("Weather?", "", calls, tools=WRAPPER_TOOLS)
    want = ("Weather?", "", [("get_weather", '{"city": "Paris", "days": 3}'), ("get_weather", '{"city": "Rome"}')])
    assert_split_invariant(prompt_ids, gen_ids, gen_text, want, tools=WRAPPER_TOOLS)


def test_truncated_arguments_wrapper_is_closed_and_unwrapped():
    head = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="arguments" string="false">{"city": "Oslo"}'
    )
    for chunks in ([head], random_chunks(head, random.Random(7))):
        result, deltas = run(chunks, by_ids=False, thinking=False, tools=WRAPPER_TOOLS)
        assert summary(result)[2] == [("get_weather", '{"city": "Oslo"}')]
        check_stream(result, deltas)
