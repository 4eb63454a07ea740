"""History normalisation conformance (issue 18 items 2 and 6; docs/model.md §7.3, §7.9, §7.10a): tool-call
arguments of assistant history and tool-result order under incremental encoding (``context``)."""

from __future__ import annotations

import pytest

from v41.chat import encode_messages, render_messages
from v41.testing.tokenizer_files import load_tiny_tokenizer

TOK = load_tiny_tokenizer()


def call(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def history(arguments) -> list[dict]:
    return [
        {"role": "user", "content": "Refresh it."},
        {"role": "assistant", "content": "", "tool_calls": [call("r", "refresh", arguments)]},
        {"role": "tool", "tool_call_id": "r", "content": "done"},
    ]


@pytest.mark.parametrize("revision", ["v41", "v4-original"])
@pytest.mark.parametrize("empty", ["", "   ", "\n"])
def test_empty_string_arguments_in_history_render_an_empty_invoke(empty, revision):
    kw = dict(thinking=False, revision=revision)
    got = render_messages(history(empty), **kw)
    assert got == render_messages(history("{}"), **kw) == render_messages(history(None), **kw)
    assert 'name="arguments"' not in got
    assert encode_messages(TOK, history(empty), **kw) == encode_messages(TOK, history({}), **kw)


CONTEXT = [
    {"role": "user", "content": "Check three things."},
    {"role": "assistant", "content": "",
     "tool_calls": [call("a", "f", "{}"), call("b", "g", "{}"), call("c", "h", "{}")]},
]
RESULTS = [
    {"role": "tool", "tool_call_id": "c", "content": "C"},
    {"role": "tool", "tool_call_id": "a", "content": "A"},
    {"role": "tool", "tool_call_id": "b", "content": "B"},
]
IN_ORDER = "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\n<tool_result>C</tool_result>"


@pytest.mark.parametrize("thinking", [False, True])
def test_context_tool_results_follow_the_call_order_of_the_assistant_in_context(thinking):
    kw = dict(thinking=thinking)
    new = render_messages(RESULTS, context=CONTEXT, **kw)
    assert new.startswith(IN_ORDER)
    assert render_messages(CONTEXT + RESULTS, **kw).endswith(new)  # as the reference: context + new sorted together
    ids = encode_messages(TOK, RESULTS, context=CONTEXT, **kw)
    assert encode_messages(TOK, CONTEXT + RESULTS, **kw)[-len(ids):] == ids


def test_results_answer_the_latest_assistant_whichever_side_of_the_context_it_is():
    later = [{"role": "user", "content": "Again."},
             {"role": "assistant", "content": "", "tool_calls": [call("b", "g", "{}"), call("a", "f", "{}")]}]
    got = render_messages(later + RESULTS[1:], context=CONTEXT + RESULTS, thinking=False)
    assert "<｜User｜><tool_result>B</tool_result>\n\n<tool_result>A</tool_result>" in got
