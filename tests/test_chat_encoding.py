"""Tests for ``v41.chat`` encoding (docs/model.md §7.1-§7.9, §7.12; docs/numerics.md §4; KF-05..KF-07).

The GOLDEN_* strings are copied byte for byte from the worked examples of §7.12 (A-D: V4.1, E: V4
original, produced by the official V4 encoder). Ids are checked against the reference tokenization of the
golden string (``encode(prompt, add_special_tokens=False)`` with marker matching on), which the docs/numerics.md §4
run-wise tokenization must reproduce for ordinary content. The tiny tokenizer has every §7.2 marker as one
token but different ids from the real model, so no id is hard-coded.
"""

from __future__ import annotations

import json
import shutil

import pytest

from v41.chat import encode_chat, encode_messages, render_messages
from v41.chat import formats as F
from v41.testing.tokenizer_files import TOKENIZER_DIR, load_tiny_tokenizer

TOK = load_tiny_tokenizer()
ID = {m: TOK.token_to_id(m) for m in F.CONTROL_MARKERS}
MARKER_IDS = set(ID.values())

GOLDEN_A = (
    "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the "
    "more thorough the reasoning)\n"
    "\n"
    "You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>"
)

GOLDEN_B = (
    "<｜begin▁of▁sentence｜><｜System｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜></think>"
)

GOLDEN_C = (
    "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the "
    "more thorough the reasoning)\n"
    "\n"
    "You are a helpful assistant.\n"
    "\n"
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by "
    'writing a "<｜DSML｜ calls>" block like the following:\n'
    "\n"
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME">\n'
    '<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ '
    "parameter>\n"
    "...\n"
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    '{"name": "get_weather", "description": "Get the weather forecast for a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}\n'
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n"
    "<｜User｜>Weather in Paris for 2 days?<｜Assistant｜><think>I should call get_weather.</think>\n"
    "\n"
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    '</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>{"forecast": ["sun", '
    '"rain"]}</tool_result><｜Assistant｜><think>Sun, then rain.</think>Sunny tomorrow, rain the day '
    "after.<｜end▁of▁sentence｜><｜User｜>Do I need an umbrella?<｜Assistant｜><think>"
)

GOLDEN_D = (
    "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the "
    "more thorough the reasoning)\n"
    "\n"
    "You are a helpful assistant.<｜User｜>Hi<｜Assistant｜></think>Hello! How can I "
    "help?<｜end▁of▁sentence｜><｜User｜>What is 3*7?<｜Assistant｜><think>"
)

GOLDEN_E = (
    "<｜begin▁of▁sentence｜>You are a helpful assistant.\n"
    "\n"
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by "
    'writing a "<｜DSML｜tool_calls>" block like the following:\n'
    "\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    '{"name": "get_weather", "description": "Get the weather forecast for a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}\n'
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n"
    "<｜User｜>Weather in Paris for 2 days?<｜Assistant｜><think>I should call get_weather.</think>\n"
    "\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>{"forecast": ["sun", '
    '"rain"]}</tool_result><｜Assistant｜><think>Sun, then rain.</think>Sunny tomorrow, rain the day '
    "after.<｜end▁of▁sentence｜><｜User｜>Do I need an umbrella?<｜Assistant｜><think>"
)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
MESSAGES_A = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
]
MESSAGES_C = [
    {"role": "system", "content": "You are a helpful assistant.", "tools": [WEATHER_TOOL]},
    {"role": "user", "content": "Weather in Paris for 2 days?"},
    {
        "role": "assistant",
        "reasoning_content": "I should call get_weather.",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": ["sun", "rain"]}'},
    {"role": "assistant", "reasoning_content": "Sun, then rain.", "content": "Sunny tomorrow, rain the day after."},
    {"role": "user", "content": "Do I need an umbrella?"},
]
MESSAGES_D = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "reasoning_content": "The user greets me.", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 3*7?"},
]

GOLDENS = {
    "A": (MESSAGES_A, dict(revision="v41", thinking=True), GOLDEN_A),
    "B": (MESSAGES_A, dict(revision="v41", thinking=False), GOLDEN_B),
    "C": (MESSAGES_C, dict(revision="v41", thinking=True), GOLDEN_C),
    "D": (MESSAGES_D, dict(revision="v41", thinking=True), GOLDEN_D),
    "E": (MESSAGES_C, dict(revision="v4-original", thinking=True), GOLDEN_E),
}
BOS, EOS = F.BOS, F.EOS


def reference_ids(prompt: str) -> list[int]:
    """The reference encoder's tokenization: the whole string, marker matching on."""
    return TOK.encode(prompt, add_special_tokens=False).ids


def call(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ----------------------------------------------------------------------------- §7.12 golden vectors


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden_render_is_byte_exact(name):
    messages, kwargs, want = GOLDENS[name]
    assert render_messages(messages, **kwargs) == want


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden_ids_equal_reference_tokenization(name):
    messages, kwargs, want = GOLDENS[name]
    ids = encode_messages(TOK, messages, **kwargs)
    assert ids == reference_ids(want)
    assert TOK.decode(ids, skip_special_tokens=False) == want


def test_golden_defaults_are_thinking_on_effort_high_v41():
    assert render_messages(MESSAGES_A) == GOLDEN_A
    assert encode_messages(TOK, MESSAGES_C) == reference_ids(GOLDEN_C)


def test_golden_d_without_drop_keeps_first_reasoning():
    got = render_messages(MESSAGES_D, drop_thinking=False)
    assert "<｜User｜>Hi<｜Assistant｜><think>The user greets me.</think>Hello! How can I help?" + EOS in got
    assert got.endswith("<｜User｜>What is 3*7?<｜Assistant｜><think>")


def test_golden_e_other_v4_profiles_only_change_the_effort_text():
    body = GOLDEN_E[len(BOS) :]
    assert render_messages(MESSAGES_C, revision="v4-0731") == GOLDEN_E
    assert render_messages(MESSAGES_C, revision="v4-0731", reasoning_effort="low") == GOLDEN_E
    assert render_messages(MESSAGES_C, revision="v4-0731", reasoning_effort="high") == BOS + F.V4_EFFORT_TEXT_H + body
    assert render_messages(MESSAGES_C, revision="v4-0731", reasoning_effort="max") == BOS + F.V4_EFFORT_TEXT_M + body
    assert render_messages(MESSAGES_C, revision="v4-original", reasoning_effort="high") == GOLDEN_E
    assert (
        render_messages(MESSAGES_C, revision="v4-original", reasoning_effort="max") == BOS + F.V4_EFFORT_TEXT_H + body
    )


# ----------------------------------------------------------------------------- effort (§7.4.1)


@pytest.mark.parametrize(
    "effort,number", [("low", 50), ("high", 75), ("max", 100), (None, 75), (1, 1), (42, 42), (100, 100)]
)
def test_v41_effort_line_values(effort, number):
    got = render_messages([{"role": "user", "content": "Q"}], reasoning_effort=effort)
    line = f"Reasoning Effort: {number} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    want = f"{BOS}<｜System｜>{line}<｜User｜>Q<｜Assistant｜><think>"
    assert got == want


@pytest.mark.parametrize("effort", ["low", "high", "max", 7])
def test_effort_line_absent_in_chat_mode(effort):
    assert render_messages([{"role": "user", "content": "Q"}], thinking=False, reasoning_effort=effort) == (
        f"{BOS}<｜User｜>Q<｜Assistant｜></think>"
    )


@pytest.mark.parametrize(
    "revision,effort",
    [
        ("v41", "xhigh"),
        ("v41", "none"),
        ("v41", "medium"),
        ("v41", 0),
        ("v41", 101),
        ("v41", True),
        ("v41", 50.0),
        ("v41", "75"),
        ("v4-original", "low"),
        ("v4-original", 50),
        ("v4-0731", "xhigh"),
        ("v4-0731", 100),
    ],
)
@pytest.mark.parametrize("thinking", [True, False])
def test_bad_effort_is_rejected_in_both_modes(revision, effort, thinking):
    with pytest.raises(ValueError, match="reasoning_effort"):
        render_messages(
            [{"role": "user", "content": "Q"}], revision=revision, thinking=thinking, reasoning_effort=effort
        )


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "messages,kwargs,match",
    [
        ([{"role": "robot", "content": "x"}], {}, "unknown role 'robot'"),
        ([{"content": "x"}], {}, "unknown role None"),
        ([{"role": "developer", "content": "x"}], {}, "developer"),
        ([], {}, "empty"),
        ("hello", {}, "list"),
        ([{"role": "user", "content": 5}], {}, "content"),
        ([{"role": "user", "content": "x", "task": "dance"}], {}, "task"),
        ([{"role": "user", "content": "x"}], {"revision": "v5"}, "revision"),
        ([{"role": "user", "content": "x"}], {"thinking": "yes"}, "thinking"),
        ([{"role": "user", "content": "x"}], {"tools": [{"name": "f"}]}, "tools"),
        ([{"role": "user", "content": "x"}], {"continue_final_message": True}, "final assistant"),
        ([{"role": "assistant", "content": "x", "tool_calls": [{"id": "a"}]}], {}, "tool_calls"),
        ([{"role": "developer", "content": ""}], {"revision": "v4-original"}, "non-empty"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], {"revision": "v4-original"}, "image"),
        ([{"role": "system", "content": "S", "tools": [WEATHER_TOOL]}], {"tools": [WEATHER_TOOL]}, "tools given both"),
    ],
)
def test_bad_requests_raise_value_error(messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        render_messages(messages, **kwargs)
    with pytest.raises(ValueError, match=match):
        encode_messages(TOK, messages, **kwargs)


def test_developer_role_renders_as_user_turn_in_v4():
    got = render_messages(
        [{"role": "system", "content": "S"}, {"role": "developer", "content": "D", "tools": [SEARCH_TOOL]}],
        revision="v4-original",
        thinking=False,
    )
    assert got.startswith(f"{BOS}S<｜User｜>D\n\n## Tools\n\n")
    assert got.endswith("invoke tool calls.\n<｜Assistant｜></think>")


def test_missing_marker_fails_at_load_with_its_name(tmp_path):
    data = json.loads(TOK.to_str())
    for added in data["added_tokens"]:
        if added["content"] == F.SYSTEM:
            added["content"] = "<｜Sys｜>"
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError, match="System"):
        encode_messages(tmp_path, MESSAGES_A, revision="v41")
    # V4 never writes <｜System｜>, so the same tokenizer serves the V4 format.
    assert encode_messages(tmp_path, MESSAGES_A, revision="v4-original") == reference_ids(
        render_messages(MESSAGES_A, revision="v4-original")
    )


# ----------------------------------------------------------------------------- model directory / revision


@pytest.mark.parametrize("model_type,revision", [("deepseek_v41", "v41"), ("deepseek_v4", "v4-original")])
def test_model_directory_picks_revision_from_model_type(tmp_path, model_type, revision):
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}), encoding="utf-8")
    want = render_messages(MESSAGES_C, revision=revision)
    assert render_messages(MESSAGES_C, model_dir=tmp_path) == want
    assert encode_messages(tmp_path, MESSAGES_C) == reference_ids(want)
    assert encode_messages(str(tmp_path), MESSAGES_C, revision="v41") == reference_ids(GOLDEN_C)


def test_model_directory_without_tokenizer_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        encode_messages(tmp_path, MESSAGES_A)


# ----------------------------------------------------------------------------- docs/numerics.md §4 tokenization

CONTROL_TEXT = (
    "<｜User｜>hi</think><think><｜end▁of▁sentence｜><｜begin▁of▁sentence｜>｜DSML｜<｜System｜><｜deepseek_image｜>"
)


@pytest.mark.parametrize("revision", ["v41", "v4-original"])
def test_user_typed_control_strings_stay_plain_text(revision):
    messages = [
        {"role": "system", "content": "sys " + CONTROL_TEXT},
        {"role": "user", "content": CONTROL_TEXT},
        {"role": "assistant", "reasoning_content": CONTROL_TEXT, "content": CONTROL_TEXT},
        {"role": "user", "content": "again " + CONTROL_TEXT},
    ]
    ids = encode_messages(TOK, messages, revision=revision, drop_thinking=False)
    text = render_messages(messages, revision=revision, drop_thinking=False)
    assert TOK.decode(ids, skip_special_tokens=False) == text
    structural = [t for t in ids if t in MARKER_IDS]
    if revision == "v41":
        head = [ID[F.BOS], ID[F.SYSTEM]]
    else:
        head = [ID[F.BOS]]
    assert structural == head + [
        ID[F.USER], ID[F.ASSISTANT], ID[F.THINK_OPEN], ID[F.THINK_CLOSE], ID[F.EOS],
        ID[F.USER], ID[F.ASSISTANT], ID[F.THINK_OPEN],
    ]  # fmt: skip
    single = encode_messages(TOK, [{"role": "user", "content": CONTROL_TEXT}], revision=revision, thinking=False)
    body = single[2:-2]
    assert single[:2] == [ID[F.BOS], ID[F.USER]] and single[-2:] == [ID[F.ASSISTANT], ID[F.THINK_CLOSE]]
    assert not MARKER_IDS & set(body) and TOK.decode(body) == CONTROL_TEXT


def test_markers_in_template_text_are_ids_but_in_tool_schemas_are_text():
    tool = {"type": "function", "function": {"name": "f", "description": "emit <think> or ｜DSML｜ literally"}}
    ids = encode_messages(TOK, [{"role": "user", "content": "Q"}], tools=[tool], thinking=False)
    text = render_messages([{"role": "user", "content": "Q"}], tools=[tool], thinking=False)
    assert TOK.decode(ids, skip_special_tokens=False) == text
    # Preamble: 9 ｜DSML｜ tags, "triggered by <think>", "<think>...</think>", "after </think>"; none from the schema.
    assert ids.count(ID[F.DSML]) == 9
    assert ids.count(ID[F.THINK_OPEN]) == 2
    assert ids.count(ID[F.THINK_CLOSE]) == 2 + 1  # + the chat-mode header
    schema_start = text.index('{"name": "f"')
    assert text.count("｜DSML｜") == 10 and text.index("｜DSML｜ literally") > schema_start


def test_plain_runs_are_tokenized_in_one_piece():
    content = "Hello world, hello world.\n\nSecond paragraph."
    ids = encode_messages(TOK, [{"role": "user", "content": content}], thinking=False)
    assert ids == [ID[F.BOS], ID[F.USER]] + TOK.encode(content, add_special_tokens=False).ids + [
        ID[F.ASSISTANT], ID[F.THINK_CLOSE],
    ]  # fmt: skip


# ----------------------------------------------------------------------------- known failures


def test_kf05_tools_follow_the_system_text():
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Beijing?"},
    ]
    for thinking in (True, False):
        with_tools = render_messages(messages, tools=[WEATHER_TOOL, SEARCH_TOOL], thinking=thinking)
        without = render_messages(messages, thinking=thinking)
        system_end = without.index("You are a helpful assistant.") + len("You are a helpful assistant.")
        assert with_tools.startswith(without[:system_end] + "\n\n## Tools\n\n")
        i_sys = with_tools.index("You are a helpful assistant.")
        i_tools = with_tools.index("## Tools")
        i_schema1 = with_tools.index('{"name": "get_weather"')
        i_schema2 = with_tools.index('{"name": "search"')
        i_user = with_tools.index("<｜User｜>What's the weather in Beijing?")
        assert with_tools.startswith(BOS) and with_tools.count(BOS) == 1
        assert i_sys < i_tools < i_schema1 < i_schema2 < i_user
        ids_with = encode_messages(TOK, messages, tools=[WEATHER_TOOL, SEARCH_TOOL], thinking=thinking)
        ids_without = encode_messages(TOK, messages, thinking=thinking)
        shared = len(reference_ids(without[:system_end]))
        assert ids_with[:shared] == ids_without[:shared]


def test_kf05_tools_without_system_message_get_an_empty_system_message():
    user = [{"role": "user", "content": "Q"}]
    chat = render_messages(user, tools=[WEATHER_TOOL], thinking=False)
    assert chat.startswith(f"{BOS}<｜System｜>\n\n## Tools\n\n")
    thinking = render_messages(user, tools=[WEATHER_TOOL])
    assert "the more thorough the reasoning)\n\n\n\n## Tools" in thinking
    assert thinking.endswith("invoke tool calls.\n<｜User｜>Q<｜Assistant｜><think>")


def test_kf06_one_bos_and_continued_assistant_prefix_is_plain_tokenization():
    prefix = '"An apple a day, keeps'
    messages = [{"role": "user", "content": "Finish the proverb."}, {"role": "assistant", "content": prefix}]
    for thinking, header in ((False, [F.ASSISTANT, F.THINK_CLOSE]), (True, [F.ASSISTANT, F.THINK_OPEN, F.THINK_CLOSE])):
        ids = encode_messages(TOK, messages, thinking=thinking, continue_final_message=True)
        assert ids[0] == ID[F.BOS] and ids.count(ID[F.BOS]) == 1
        assert ID[F.EOS] not in ids
        tail = [ID[m] for m in header]
        k = len(ids) - len(TOK.encode(prefix, add_special_tokens=False).ids)
        assert ids[k - len(tail) : k] == tail
        assert ids[k:] == TOK.encode(prefix, add_special_tokens=False).ids
    # wo_eos on the message does the same as continue_final_message (reference spelling).
    wo_eos = [messages[0], {**messages[1], "wo_eos": True}]
    assert encode_messages(TOK, wo_eos, thinking=False) == encode_messages(
        TOK, messages, thinking=False, continue_final_message=True
    )
    single = encode_messages(TOK, [{"role": "user", "content": BOS + "hi"}])
    assert single[0] == ID[F.BOS] and single.count(ID[F.BOS]) == 1


def test_kf07_image_placeholder_and_tool_calls_survive_the_multimodal_path():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}

    def conversation(first_user_content):
        return [
            {"role": "user", "content": first_user_content},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("call_0", "describe_image", '{"detail":"high"}')],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": "a red bicycle"},
            {"role": "user", "content": "And its colour?"},
        ]

    mm = conversation([{"type": "text", "text": "What is this?"}, image])
    text_only = conversation("What is this?")
    tools = [{"type": "function", "function": {"name": "describe_image", "parameters": {}}}]
    for thinking in (True, False):
        got = encode_chat(TOK, mm, tools=tools, thinking=thinking)
        plain = render_messages(text_only, tools=tools, thinking=thinking)
        assert got.text == plain.replace("What is this?", "What is this?\n\n<｜deepseek_image｜>")
        assert got.images == [image]
        assert got.token_ids.count(ID[F.IMAGE]) == 1
        assert got.token_ids == reference_ids(got.text)
        call_at = got.text.index(
            '<｜DSML｜ invoke name="describe_image">\n<｜DSML｜ parameter name="detail" string="true">high<'
        )
        result_at = got.text.index(
            "<｜User｜><tool_result>a red bicycle</tool_result>\n\nAnd its colour?<｜Assistant｜>"
        )
        assert got.text.index("<｜deepseek_image｜>") < call_at < result_at


def test_images_inside_tool_results_and_assistant_content_lists():
    img = {"type": "image", "image": "x"}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "look"}, img]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "tool_calls": [call("t", "f", "{}")],
        },
        {"role": "tool", "tool_call_id": "t", "content": [{"type": "text", "text": "r1"}, img, {"type": "audio"}]},
    ]
    got = encode_chat(TOK, messages, thinking=False)
    assert "<｜User｜>look\n\n<｜deepseek_image｜><｜Assistant｜></think>a\n\nb\n\n" in got.text
    assert "<tool_result>r1\n\n<｜deepseek_image｜>\n\n[Unsupported audio]</tool_result>" in got.text
    assert got.images == [img, img]
    assert got.token_ids.count(ID[F.IMAGE]) == 2


# ----------------------------------------------------------------------------- tool results, drop rule, layout


def test_tool_results_merge_into_one_user_turn_in_call_order():
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}"), call("b", "g", "{}")]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "user", "content": "more"},
    ]
    got = render_messages(messages, thinking=False)
    assert got.endswith(
        EOS + "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nmore<｜Assistant｜></think>"
    )


def test_unknown_result_id_sorts_first_and_text_blocks_keep_their_place():
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}"), call("b", "g", "{}")]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "user", "content": "note"},
        {"role": "tool", "tool_call_id": "zzz", "content": "Z"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
    ]
    got = render_messages(messages, thinking=False)
    # Positions of the tool results: sorted keys b->1, zzz->0, a->0 (stable): zzz, a, b.
    assert got.endswith(
        "<｜User｜><tool_result>Z</tool_result>\n\nnote\n\n<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>"
        "<｜Assistant｜></think>"
    )


def test_tool_message_without_preceding_user_starts_a_user_turn():
    got = render_messages(
        [{"role": "system", "content": "S"}, {"role": "tool", "tool_call_id": "x", "content": "R"}], thinking=False
    )
    assert got == f"{BOS}<｜System｜>S<｜User｜><tool_result>R</tool_result><｜Assistant｜></think>"


def test_drop_rule_thinking_chat_and_tools():
    messages = [
        {"role": "user", "content": "U1"},
        {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
        {"role": "user", "content": "U2"},
        {"role": "assistant", "reasoning_content": "R2", "content": "A2"},
        {"role": "user", "content": "U3"},
        {"role": "assistant", "reasoning_content": "R3", "content": "prefill", "wo_eos": True},
    ]
    head = BOS + "<｜System｜>" + F.V41_EFFORT_LINE.format(n=75)
    dropped = render_messages(messages)
    assert dropped == head + (
        f"<｜User｜>U1<｜Assistant｜></think>A1{EOS}<｜User｜>U2<｜Assistant｜></think>A2{EOS}"
        "<｜User｜>U3<｜Assistant｜><think>R3</think>prefill"
    )
    kept = (
        f"<｜User｜>U1<｜Assistant｜><think>R1</think>A1{EOS}<｜User｜>U2<｜Assistant｜><think>R2</think>A2{EOS}"
        "<｜User｜>U3<｜Assistant｜><think>R3</think>prefill"
    )
    assert render_messages(messages, drop_thinking=False) == head + kept
    with_tools = render_messages(messages, tools=[WEATHER_TOOL])
    assert with_tools.endswith(kept)
    chat = render_messages(messages, thinking=False)
    assert chat == (
        f"{BOS}<｜User｜>U1<｜Assistant｜></think>A1{EOS}<｜User｜>U2<｜Assistant｜></think>A2{EOS}"
        "<｜User｜>U3<｜Assistant｜></think>prefill"
    )


def test_empty_reasoning_renders_bare_close_tag_when_kept():
    messages = [
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "V"},
    ]
    got = render_messages(messages, drop_thinking=False)
    assert f"<｜User｜>U<｜Assistant｜><think></think>A{EOS}<｜User｜>V<｜Assistant｜><think>" in got


def test_mid_conversation_system_messages():
    v41 = render_messages(
        [
            {"role": "user", "content": "Hello"},
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Bonjour"},
        ]
    )
    assert v41.endswith("<｜User｜>Hello<｜System｜>Answer in French.<｜User｜>Bonjour<｜Assistant｜><think>")
    after_assistant = render_messages(
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hi!"},
            {"role": "system", "content": "Answer in French."},
        ]
    )
    assert after_assistant.endswith(f"Hi!{EOS}<｜System｜>Answer in French.<｜Assistant｜><think>")
    v4 = render_messages(
        [{"role": "user", "content": "Q"}, {"role": "system", "content": "mid"}, {"role": "user", "content": "Q2"}],
        revision="v4-original",
    )
    assert v4 == f"{BOS}<｜User｜>Qmid<｜User｜>Q2<｜Assistant｜><think>"


def test_latest_reminder_before_user_turn():
    got = render_messages(
        [
            {"role": "system", "content": "S"},
            {"role": "latest_reminder", "content": "2026-09-20, Paris"},
            {"role": "user", "content": "Q"},
        ],
        thinking=False,
    )
    assert got == f"{BOS}<｜System｜>S<｜latest_reminder｜>2026-09-20, Paris<｜User｜>Q<｜Assistant｜></think>"


def test_response_format_section():
    rf = {"type": "json_object"}
    got = render_messages(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], thinking=False, response_format=rf
    )
    assert got == (
        f"{BOS}<｜System｜>S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_object"}<｜User｜>Q<｜Assistant｜></think>'
    )
    both = render_messages([{"role": "user", "content": "Q"}], thinking=False, response_format=rf, tools=[WEATHER_TOOL])
    assert "invoke tool calls.\n\n\n## Response Format:" in both


def test_tasks():
    action = render_messages(
        [
            {"role": "user", "content": "Find it", "task": "action"},
            {"role": "assistant", "reasoning_content": "x", "content": "Search"},
        ],
        thinking=False,
    )
    assert action == f"{BOS}<｜User｜>Find it<｜Assistant｜></think><｜action｜>Search{EOS}"
    action_thinking = render_messages(
        [
            {"role": "user", "content": "Find it", "task": "action"},
            {"role": "assistant", "reasoning_content": "x", "content": "Search"},
        ]
    )
    assert action_thinking.endswith(
        f"<｜User｜>Find it<｜Assistant｜><think><｜action｜>Search{EOS}"
    )  # no thinking part
    query = render_messages([{"role": "user", "content": "Q", "task": "query"}], thinking=False)
    assert query == f"{BOS}<｜User｜>Q<｜query｜>"
    title = render_messages(
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "task": "title"}], thinking=False
    )
    assert title.endswith(f"A{EOS}<｜title｜>")
    ids = encode_messages(TOK, [{"role": "user", "content": "Q", "task": "read_url"}], thinking=False)
    assert ids[-1] == ID["<｜read_url｜>"]


def test_add_generation_prompt_false_leaves_no_header():
    assert render_messages(MESSAGES_A, thinking=False, add_generation_prompt=False) == (
        f"{BOS}<｜System｜>You are a helpful assistant.<｜User｜>What is 2+2?"
    )


def test_tool_call_arguments_forms_and_empty_parameters():
    messages = [
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [
                call("1", "obj", {"b": 1.5, "a": "北京"}),
                call("2", "double", json.dumps(json.dumps({"k": [1, None, True]}))),
                call("3", "scalar", "[1, 2]"),
                call("4", "bad", "{not json"),
                call("5", "none", "{}"),
            ],
        },
    ]
    got = render_messages(messages, thinking=False, add_generation_prompt=False)
    block = got[got.index("Calling.") :]
    assert block == (
        "Calling.\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="obj">\n'
        '<｜DSML｜ parameter name="b" string="false">1.5</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="a" string="true">北京</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="double">\n'
        '<｜DSML｜ parameter name="k" string="false">[1, null, true]</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="scalar">\n'
        '<｜DSML｜ parameter name="arguments" string="true">[1, 2]</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="bad">\n'
        '<｜DSML｜ parameter name="arguments" string="true">{not json</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="none">\n'
        "\n"
        "</｜DSML｜ invoke>\n"
        f"</｜DSML｜ calls>{EOS}"
    )
    v4 = render_messages(messages, thinking=False, revision="v4-original", add_generation_prompt=False)
    assert '<｜DSML｜invoke name="obj">\n<｜DSML｜parameter name="b" string="false">1.5</｜DSML｜parameter>' in v4
    assert v4.endswith(f"</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}")


def test_tool_schema_json_text_is_python_dumps_with_unicode():
    tool = {"type": "function", "function": {"name": "天气", "parameters": {"x": 1.0, "y": [True, None], "z": "é"}}}
    got = render_messages([{"role": "user", "content": "Q"}], tools=[tool], thinking=False)
    assert '\n{"name": "天气", "parameters": {"x": 1.0, "y": [true, null], "z": "é"}}\n\nYou MUST strictly' in got


def test_incremental_encoding_with_context_continues_the_prompt():
    context = MESSAGES_D[:2]
    new = [MESSAGES_D[2], MESSAGES_D[3]]
    for thinking in (False, True):
        for drop in (False, True):
            kw = dict(thinking=thinking, drop_thinking=drop)
            full = render_messages(context + new, **kw)
            first = render_messages(context, **kw)
            rest = render_messages(new, context=context, **kw)
            if thinking and drop:
                # The drop rule runs over context + new, so turn 1's header changes (§7.8); the new part
                # is still the tail of the full prompt.
                assert full.endswith(rest) and not rest.startswith(BOS) and not first + rest == full
            else:
                assert first + rest == full
                ids = encode_messages(TOK, new, context=context, **kw)
                assert encode_messages(TOK, context, **kw) + ids == encode_messages(TOK, context + new, **kw)


def test_encode_chat_reports_text_and_mode():
    got = encode_chat(TOK, MESSAGES_A, thinking=False)
    assert got.text == GOLDEN_B and got.thinking is False and got.revision == "v41" and got.images == []
