"""Rendering of tool definitions (the tools section) and of historical tool calls (DSML blocks).

Source: docs/model.md §7.5 (tools section), §7.6 (DSML call block), §7.3 (JSON text rules).

Tag text is template text (``｜DSML｜`` becomes its token id); tool names, parameter names, values and
schemas are message data (plain text, inserted raw: the format has no escaping, so a string value that
contains ``</｜DSML｜`` cannot round-trip through any DSML parser).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .formats import DSML, RESPONSE_FORMAT_HEAD, TOOLS_TAIL, DsmlTags, tools_head
from .normalize import ToolCall
from .segments import PromptBuilder


def json_text(value: Any) -> str:
    """JSON text as the reference writes it (§7.3): ``ensure_ascii=False``, default separators, key order
    kept. Errors: ``ValueError`` for values JSON cannot represent."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"value is not JSON-serialisable: {exc}") from None


def render_tools_section(b: PromptBuilder, tools: Sequence[dict[str, Any]], tags: DsmlTags) -> None:
    """``## Tools`` preamble, one JSON schema (the ``function`` object) per line, closing sentence."""
    b.template(tools_head(tags))
    b.text("\n".join(json_text(t) for t in tools))
    b.text(TOOLS_TAIL)


def render_response_format(b: PromptBuilder, response_format: Any) -> None:
    """Response-format section (§7.9), without the ``\\n\\n`` that separates it from what precedes."""
    b.text(RESPONSE_FORMAT_HEAD)
    b.text(json_text(response_format))


def render_tool_calls(b: PromptBuilder, calls: Sequence[ToolCall], tags: DsmlTags) -> None:
    """``\\n\\n`` + the DSML block of ``calls`` (no EOS): calls in order, parameters in key order, one per
    line; ``string="true"`` exactly for string values (inserted raw), JSON text otherwise (§7.6)."""
    b.text("\n\n")
    b.template(f"<{DSML}{tags.block}>\n")
    for k, call in enumerate(calls):
        if k:
            b.text("\n")
        b.template(f"<{DSML}{tags.invoke}")
        b.text(f' name="{call.name}">\n')
        for j, (key, value) in enumerate(call.arguments.items()):
            if j:
                b.text("\n")
            is_string = isinstance(value, str)
            b.template(f"<{DSML}{tags.parameter}")
            b.text(f' name="{key}" string="{"true" if is_string else "false"}">')
            b.text(value if is_string else json_text(value))
            b.template(f"</{DSML}{tags.parameter}>")
        b.text("\n")
        b.template(f"</{DSML}{tags.invoke}>")
    b.text("\n")
    b.template(f"</{DSML}{tags.block}>")
