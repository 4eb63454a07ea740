"""Format data of the DeepSeek-V4.1 / V4 chat prompts: marker strings, revisions, fixed texts.

Source: docs/model.md §7.1 (revisions), §7.2 (markers), §7.4.1 (reasoning effort texts), §7.5 (tools
section), §7.6 (DSML tag spellings), §7.9 (response format). Marker strings and the quoted texts are the
model's format and must stay byte-exact; they use U+FF5C ``｜`` and U+2581 ``▁``, never ASCII lookalikes.

Invariant: no marker is a prefix or a substring of another marker, and no marker's suffix is another
marker's prefix (all markers start with ``<`` or ``｜`` and end with ``>`` or ``｜``); the streaming parser
relies on it when it holds back partial markers.
"""

from __future__ import annotations

from dataclasses import dataclass

# --------------------------------------------------------------------------- markers (§7.2)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"  # V4.1 only
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜deepseek_image｜>"  # V4.1 image placeholder

# Internal quick-instruction tasks (§7.9): task name -> marker.
TASK_MARKERS: dict[str, str] = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# Every control string of §7.2 (also those the encoder never writes): typed by a user, each stays plain
# text; in template text, each becomes its token id.
CONTROL_MARKERS: tuple[str, ...] = (
    BOS,
    EOS,
    "<｜▁pad▁｜>",
    SYSTEM,
    USER,
    ASSISTANT,
    THINK_OPEN,
    THINK_CLOSE,
    DSML,
    LATEST_REMINDER,
    *TASK_MARKERS.values(),
    "<｜extracted_url｜>",
    IMAGE,
    "<|place_holder_mm_span_0436|>",
)

# --------------------------------------------------------------------------- DSML tags (§7.6)


@dataclass(frozen=True, slots=True)
class DsmlTags:
    """Tag names written after ``｜DSML｜`` (V4.1 puts a space before each name, V4 does not)."""

    block: str
    invoke: str
    parameter: str


DSML_V41 = DsmlTags(block=" calls", invoke=" invoke", parameter=" parameter")
DSML_V4 = DsmlTags(block="tool_calls", invoke="invoke", parameter="parameter")

# --------------------------------------------------------------------------- revisions (§7.1)

V41 = "v41"
V4_ORIGINAL = "v4-original"
V4_0731 = "v4-0731"
REVISIONS = (V41, V4_ORIGINAL, V4_0731)

# model_type in config.json -> default revision (the V4 0731 variants cannot be told apart from config).
DEFAULT_REVISION_BY_MODEL_TYPE = {"deepseek_v41": V41, "deepseek_v4": V4_ORIGINAL}


@dataclass(frozen=True, slots=True)
class FormatProfile:
    """What differs between the format revisions of §7.1.

    ``system_marker``: V4.1 writes ``<｜System｜>`` (index-0 prefix and mid-conversation system turns);
    ``developer_role``: V4 accepts ``developer``; ``content_lists``: V4.1 turns content lists with images
    into blocks with the image placeholder; ``efforts``: accepted effort names (V4.1 also takes ints 1-100).
    """

    name: str
    dsml: DsmlTags
    system_marker: bool
    developer_role: bool
    content_lists: bool
    efforts: tuple[str, ...]
    numeric_effort: bool

    @property
    def roles(self) -> tuple[str, ...]:
        base = ("system", "user", "assistant", "tool", "latest_reminder")
        return base + ("developer",) if self.developer_role else base

    def markers(self) -> tuple[str, ...]:
        """Markers the encoder of this revision writes (each must be one token of the tokenizer)."""
        used = [BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, DSML, LATEST_REMINDER, *TASK_MARKERS.values()]
        if self.system_marker:
            used.append(SYSTEM)
        if self.content_lists:
            used.append(IMAGE)
        return tuple(used)


PROFILES: dict[str, FormatProfile] = {
    V41: FormatProfile(V41, DSML_V41, True, False, True, ("low", "high", "max"), True),
    V4_ORIGINAL: FormatProfile(V4_ORIGINAL, DSML_V4, False, True, False, ("high", "max"), False),
    V4_0731: FormatProfile(V4_0731, DSML_V4, False, True, False, ("low", "high", "max"), False),
}


def profile(revision: str) -> FormatProfile:
    """The profile of ``revision``; ``ValueError`` names the known revisions."""
    try:
        return PROFILES[revision]
    except (KeyError, TypeError):
        raise ValueError(f"unknown chat format revision {revision!r}; expected one of {list(REVISIONS)}") from None


# --------------------------------------------------------------------------- reasoning effort (§7.4.1)

V41_EFFORT_VALUES = {"low": 50, "high": 75, "max": 100}
V41_DEFAULT_EFFORT = "high"
V41_EFFORT_LINE = "Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

# Text H: V4 original `max`, V4 0731 `high`.
V4_EFFORT_TEXT_H = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
# Text M: V4 0731 `max` (U+2014 em dash after "Beyond maximum").
V4_EFFORT_TEXT_M = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
V4_EFFORT_TEXTS: dict[str, dict[str | None, str]] = {
    V4_ORIGINAL: {None: "", "high": "", "max": V4_EFFORT_TEXT_H},
    V4_0731: {None: "", "low": "", "high": V4_EFFORT_TEXT_H, "max": V4_EFFORT_TEXT_M},
}

# --------------------------------------------------------------------------- tools section (§7.5)

# Placeholders: {open}/{close} = "<｜DSML｜" / "</｜DSML｜"; {block}/{invoke}/{parameter} = DsmlTags names.
_TOOLS_HEAD = (
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"{open}{block}>" block like the following:\n'
    "\n"
    "{open}{block}>\n"
    '{open}{invoke} name="$TOOL_NAME">\n'
    '{open}{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{close}{parameter}>\n'
    "...\n"
    "{close}{invoke}>\n"
    '{open}{invoke} name="$TOOL_NAME2">\n'
    "...\n"
    "{close}{invoke}>\n"
    "{close}{block}>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
)
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


def tools_head(tags: DsmlTags) -> str:
    """The tools section up to the schema lines (template text: its markers become token ids)."""
    return _TOOLS_HEAD.format(
        open="<" + DSML, close="</" + DSML, block=tags.block, invoke=tags.invoke, parameter=tags.parameter
    )


# --------------------------------------------------------------------------- response format (§7.9)

RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
