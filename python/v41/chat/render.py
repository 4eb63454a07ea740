"""Prompt layout: message bodies, transitions, the index-0 prefix and the historical-reasoning drop rule.

Source: docs/model.md §7.4 (bodies and transitions), §7.4.1 (effort), §7.8 (drop rule), §7.9
(mid-conversation system, tasks, continuation, incremental encoding).

The prompt is BOS, then per message its body and its transition. With the drop on (thinking mode,
``drop_thinking``, no message with tools), assistant messages before the last user turn L lose their
reasoning, V4 developer messages before L disappear, user turns before L get ``<｜Assistant｜></think>`` and
turn L gets ``<｜Assistant｜><think>``. Pure function of its arguments; cost linear in the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .formats import (
    ASSISTANT,
    BOS,
    EOS,
    LATEST_REMINDER,
    SYSTEM,
    TASK_MARKERS,
    THINK_CLOSE,
    THINK_OPEN,
    USER,
    V4_EFFORT_TEXTS,
    V41_DEFAULT_EFFORT,
    V41_EFFORT_LINE,
    V41_EFFORT_VALUES,
    FormatProfile,
)
from .normalize import ChatMessage, ImagePart, Part, TextBlock, ToolResultBlock
from .segments import PromptBuilder
from .tools import render_response_format, render_tool_calls, render_tools_section


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """``thinking``: thinking mode; ``effort``: validated effort (``check_effort``); ``drop_thinking``:
    the request's flag before the tools override; ``add_generation_prompt``: give the last message its
    transition; ``continue_final``: the last (assistant) message is a prefix the model continues."""

    thinking: bool
    effort: str | int | None
    drop_thinking: bool
    add_generation_prompt: bool
    continue_final: bool


def check_effort(prof: FormatProfile, effort: object) -> str | int | None:
    """Validate a reasoning effort for ``prof`` (§7.4.1): V4.1 a name or an int 1-100 (not a bool); V4
    a name of its profile. Checked in chat mode too, as the reference does. Errors: ``ValueError``."""
    if effort is None or (isinstance(effort, str) and effort in prof.efforts):
        return effort
    if prof.numeric_effort and type(effort) is int and 1 <= effort <= 100:
        return effort
    allowed = f"{list(prof.efforts)} or an integer 1-100" if prof.numeric_effort else f"{list(prof.efforts)} or None"
    raise ValueError(f"invalid reasoning_effort {effort!r} for the {prof.name} format; expected {allowed}")


def effort_prefix(prof: FormatProfile, effort: str | int | None) -> str:
    """Effort text placed before message 0 in thinking mode (V4.1: after ``<｜System｜>``)."""
    if prof.numeric_effort:
        value = V41_EFFORT_VALUES[effort or V41_DEFAULT_EFFORT] if not isinstance(effort, int) else effort
        return V41_EFFORT_LINE.format(n=value)
    return V4_EFFORT_TEXTS[prof.name][effort]


def is_user_turn(prof: FormatProfile, messages: list[ChatMessage], i: int) -> bool:
    role = messages[i].role
    return role in ("user", "developer") or (role == "system" and i > 0 and prof.system_marker)


def last_user_turn(prof: FormatProfile, messages: list[ChatMessage]) -> int:
    return max((i for i in range(len(messages)) if is_user_turn(prof, messages, i)), default=-1)


def apply_drop(prof: FormatProfile, messages: list[ChatMessage]) -> list[ChatMessage]:
    """Before the last user turn: assistants lose reasoning, roles outside the kept set (V4 developer)
    are removed (§7.8)."""
    last = last_user_turn(prof, messages)
    out = []
    for i, m in enumerate(messages):
        if i >= last or m.role in ("user", "system", "latest_reminder"):
            out.append(m)
        elif m.role == "assistant":
            out.append(replace(m, reasoning=""))
    return out


def drop_is_on(messages: list[ChatMessage], opts: RenderOptions) -> bool:
    return opts.thinking and opts.drop_thinking and not any(m.tools for m in messages)


def render(
    prof: FormatProfile, messages: list[ChatMessage], opts: RenderOptions, context: list[ChatMessage] | None = None
) -> PromptBuilder:
    """Render ``context + messages``, emitting only ``messages`` (BOS only without context; §7.9)."""
    context = context or []
    full = context + messages
    drop = drop_is_on(full, opts)
    first = len(context)
    if drop:
        full = apply_drop(prof, full)
        first = len(apply_drop(prof, context)) if context else 0
    b = PromptBuilder()
    if not context:
        b.marker(BOS)
    last = last_user_turn(prof, full)
    for i in range(first, len(full)):
        _render_message(b, prof, full, i, opts, drop, last)
    return b


def _render_message(
    b: PromptBuilder, prof: FormatProfile, msgs: list[ChatMessage], i: int, opts: RenderOptions, drop: bool, last: int
) -> None:
    m = msgs[i]
    is_last = i == len(msgs) - 1
    if i == 0:
        if opts.thinking:
            if prof.system_marker:
                b.marker(SYSTEM)
            b.text(effort_prefix(prof, opts.effort))
        elif prof.system_marker and m.role == "system":
            b.marker(SYSTEM)

    if m.role == "system":
        if i > 0 and prof.system_marker:
            b.marker(SYSTEM)
        _render_system_like(b, prof, m)
    elif m.role == "developer":
        b.marker(USER)
        _render_system_like(b, prof, m)
    elif m.role == "user":
        b.marker(USER)
        _render_blocks(b, m)
    elif m.role == "latest_reminder":
        b.marker(LATEST_REMINDER)
        _render_blocks(b, m)
    else:  # assistant (normalize() admits no other role)
        _render_assistant(b, prof, msgs, i, opts, drop, last, continuing=is_last and opts.continue_final)

    # Transition (§7.4).
    if is_last and not opts.add_generation_prompt:
        return
    if not is_last and msgs[i + 1].role not in ("assistant", "latest_reminder"):
        return
    if m.task is not None:
        if m.task == "action":
            b.marker(ASSISTANT)
            b.marker(THINK_OPEN if opts.thinking else THINK_CLOSE)
        b.marker(TASK_MARKERS[m.task])
    elif is_user_turn(prof, msgs, i):
        b.marker(ASSISTANT)
        b.marker(THINK_OPEN if opts.thinking and (not drop or i >= last) else THINK_CLOSE)


def _render_system_like(b: PromptBuilder, prof: FormatProfile, m: ChatMessage) -> None:
    _render_blocks(b, m)
    if m.tools:
        b.text("\n\n")
        render_tools_section(b, m.tools, prof.dsml)
    if m.response_format:
        b.text("\n\n")
        render_response_format(b, m.response_format)


def _render_parts(b: PromptBuilder, parts: list[Part]) -> None:
    for p in parts:
        if isinstance(p, ImagePart):
            b.image(p.block)
        else:
            b.text(p)


def _render_blocks(b: PromptBuilder, m: ChatMessage) -> None:
    for k, block in enumerate(m.blocks):
        if k:
            b.text("\n\n")
        if isinstance(block, TextBlock):
            _render_parts(b, block.parts)
        else:
            assert isinstance(block, ToolResultBlock)
            b.text("<tool_result>")
            _render_parts(b, block.parts)
            b.text("</tool_result>")


def _render_assistant(
    b: PromptBuilder,
    prof: FormatProfile,
    msgs: list[ChatMessage],
    i: int,
    opts: RenderOptions,
    drop: bool,
    last: int,
    continuing: bool,
) -> None:
    m = msgs[i]
    answers_task = i > 0 and msgs[i - 1].task is not None
    has_content = any(p for blk in m.blocks for p in blk.parts)
    if opts.thinking and not answers_task and (not drop or i > last):
        b.text(m.reasoning)
        # Continuing inside the reasoning (vLLM's continue_final_message extension, §7.9): no </think>.
        if not (continuing and m.reasoning and not has_content and not m.tool_calls):
            b.marker(THINK_CLOSE)
    _render_blocks(b, m)
    if m.tool_calls:
        render_tool_calls(b, m.tool_calls, prof.dsml)
    if not (m.wo_eos or continuing):
        b.marker(EOS)
