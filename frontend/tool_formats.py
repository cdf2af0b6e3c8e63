"""Which tool-call format a chat template teaches: Qwen's <tool_call> blocks, else Llama 3's JSON objects (also what
required and named tool_choice write where the template shows no tools: the grammar needs no template)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from frontend.llama_tool_calls import LlamaToolCallStream, llama_tool_grammar, parse_llama_tool_calls
from frontend.tool_calls import OPEN, ToolCallStream, parse_tool_calls, tool_grammar


class ToolFormat(NamedTuple):
    grammar: Callable[[list[dict], list[str], bool], dict]  # (tools, names, only one) -> structured_outputs
    parse: Callable[[str], tuple[str | None, list[dict]]]  # a whole answer -> (content, calls)
    stream: Callable[[], object]  # -> an object with update(text, final) -> (content, deltas) and .called


HERMES = ToolFormat(tool_grammar, parse_tool_calls, ToolCallStream)
LLAMA3_JSON = ToolFormat(llama_tool_grammar, parse_llama_tool_calls, LlamaToolCallStream)


def tool_format(chat_template: str | None) -> tuple[ToolFormat, bool]:
    """(the format, whether the template shows the tools to the model: Qwen's and Llama 3.1/3.2's do)."""
    template = chat_template or ""
    if OPEN in template:
        return HERMES, True
    return LLAMA3_JSON, "tools" in template
