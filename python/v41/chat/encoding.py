"""Public chat encoder: OpenAI-style messages -> the exact prompt ids DeepSeek-V4.1 / V4 were trained on.

Source: docs/model.md §7 (format), docs/numerics.md §4 (tokenization), docs/known-failures.md KF-05..KF-07.

Revisions (§7.1): ``v41`` (V4.1 release; effort ``low``/``high``/``max`` = 50/75/100 or an int 1-100,
default ``high``), ``v4-original`` and ``v4-0731``. The default comes from ``model_type`` when the tokenizer
is given as a model directory, else ``v41``. ``thinking=None`` means the model default, thinking on.

Ids: BOS once (none with ``context``), scaffolding markers as their ids, every maximal run of plain text
tokenized in one piece with marker matching off. For ordinary content this equals the reference encoder's
``tokenizer.encode(prompt, add_special_tokens=False)``; control strings typed in content stay plain text.

Continuation: ``continue_final_message=True`` (or ``wo_eos`` on the last assistant message) renders the final
assistant message without EOS and without a following header, so the model continues it. In thinking mode a
final assistant message with reasoning but no content or calls renders without ``</think>`` (the model
continues its reasoning; an extension the reference encoder lacks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from .formats import V41, profile
from .normalize import attach_request_fields, latest_call_order, normalize
from .render import RenderOptions, check_effort, render
from .segments import PromptBuilder
from .tokens import chat_tokenizer, default_revision

Messages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    """``token_ids``: prompt ids; ``text``: the reference prompt string; ``images``: image parts of the
    request in prompt order, one per ``<｜deepseek_image｜>`` id; ``thinking``: effective thinking mode."""

    token_ids: list[int]
    text: str
    images: list[Any]
    revision: str
    thinking: bool


def _build(
    revision: str,
    messages: Messages,
    tools: Sequence[Any] | None,
    thinking: bool | None,
    reasoning_effort: str | int | None,
    add_generation_prompt: bool,
    response_format: Any,
    drop_thinking: bool | None,
    continue_final_message: bool,
    context: Messages | None,
) -> tuple[PromptBuilder, bool]:
    prof = profile(revision)
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"thinking must be true, false or null, got {thinking!r}")
    if drop_thinking is not None and not isinstance(drop_thinking, bool):
        raise ValueError(f"drop_thinking must be true, false or null, got {drop_thinking!r}")
    effort = check_effort(prof, reasoning_effort)
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of message objects")
    if not messages and not context:
        raise ValueError("messages is empty")
    if continue_final_message and (
        not messages or not isinstance(messages[-1], Mapping) or messages[-1].get("role") != "assistant"
    ):
        raise ValueError("continue_final_message needs a final assistant message")
    ctx = list(context or [])
    if ctx:
        ctx = attach_request_fields(ctx, tools, response_format)
        msgs = list(messages)
    else:
        msgs = attach_request_fields(messages, tools, response_format)
    norm_ctx = normalize(ctx, prof) if ctx else []
    # Results may answer an assistant message of the context: order them as the reference does, over context
    # and new messages together (docs/model.md §7.3 "Result order", §7.9).
    norm = normalize(msgs, prof, latest_call_order(norm_ctx))
    opts = RenderOptions(
        thinking=True if thinking is None else thinking,
        effort=effort,
        drop_thinking=True if drop_thinking is None else drop_thinking,
        add_generation_prompt=add_generation_prompt,
        continue_final=continue_final_message,
    )
    return render(prof, norm, opts, norm_ctx), opts.thinking


def encode_chat(
    tokenizer: Tokenizer | str | os.PathLike[str],
    messages: Messages,
    tools: Sequence[Any] | None = None,
    thinking: bool | None = None,
    reasoning_effort: str | int | None = None,
    revision: str | None = None,
    add_generation_prompt: bool = True,
    response_format: Any = None,
    drop_thinking: bool | None = None,
    continue_final_message: bool = False,
    context: Messages | None = None,
) -> EncodedPrompt:
    """Encode a conversation; see :func:`encode_messages` for the arguments. Also returns the prompt string
    and the image parts in prompt order."""
    tok = chat_tokenizer(tokenizer, revision)
    b, thinking_on = _build(
        tok.revision, messages, tools, thinking, reasoning_effort, add_generation_prompt, response_format,
        drop_thinking, continue_final_message, context,
    )  # fmt: skip
    return EncodedPrompt(tok.encode_prompt(b), b.render(), list(b.images), tok.revision, thinking_on)


def encode_messages(
    tokenizer: Tokenizer | str | os.PathLike[str],
    messages: Messages,
    tools: Sequence[Any] | None = None,
    thinking: bool | None = None,
    reasoning_effort: str | int | None = None,
    revision: str | None = None,
    add_generation_prompt: bool = True,
    response_format: Any = None,
    drop_thinking: bool | None = None,
    continue_final_message: bool = False,
    context: Messages | None = None,
) -> list[int]:
    """Prompt token ids for ``messages`` (§7).

    ``tokenizer``: a ``tokenizers.Tokenizer`` or a model directory (its ``config.json`` picks the default
    revision). ``tools``: OpenAI tool definitions, attached to message 0 if it is a system message, else to
    a new empty system message at index 0 (KF-05). ``thinking``: thinking mode (None = on).
    ``reasoning_effort``: §7.4.1 names (or an int 1-100 for ``v41``). ``revision``: ``v41``,
    ``v4-original`` or ``v4-0731``. ``add_generation_prompt``: end with the assistant header when the
    last message is a user turn. ``response_format``: attached like ``tools``. ``drop_thinking``: drop
    historical reasoning (None = on; always off when tools are present; §7.8). ``continue_final_message``:
    continue the final assistant message. ``context``: messages already encoded (§7.9): no BOS, only the
    new messages' ids are returned.

    Errors: ``ValueError`` for an unknown role (``developer`` in ``v41``), bad effort, bad message shape or
    a missing marker in the tokenizer; ``FileNotFoundError`` for a directory without ``tokenizer.json``.
    """
    return encode_chat(
        tokenizer, messages, tools, thinking, reasoning_effort, revision, add_generation_prompt, response_format,
        drop_thinking, continue_final_message, context,
    ).token_ids  # fmt: skip


def render_messages(
    messages: Messages,
    tools: Sequence[Any] | None = None,
    thinking: bool | None = None,
    reasoning_effort: str | int | None = None,
    revision: str | None = None,
    add_generation_prompt: bool = True,
    response_format: Any = None,
    drop_thinking: bool | None = None,
    continue_final_message: bool = False,
    context: Messages | None = None,
    model_dir: str | os.PathLike[str] | None = None,
) -> str:
    """The prompt as the reference encoder's string (for tests and debugging; the engine uses ids).

    Arguments as :func:`encode_messages`; ``revision`` defaults to ``model_dir``'s ``model_type``, else
    ``v41``. No tokenizer is needed.
    """
    rev = revision or (default_revision(model_dir) if model_dir is not None else V41)
    b, _ = _build(
        rev, messages, tools, thinking, reasoning_effort, add_generation_prompt, response_format, drop_thinking,
        continue_final_message, context,
    )  # fmt: skip
    return b.render()
