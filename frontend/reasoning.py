"""Reasoning models' thoughts apart from their answer: vLLM's `--reasoning-parser qwen3`. A Qwen3 answer that opens
with <think> thinks until </think> (reasoning), then answers (content); one that does not (enable_thinking false,
whose template closes an empty block in the prompt) is all content. Grammars start after the thoughts."""

from __future__ import annotations

REASONING_PARSERS = ("qwen3",)
START, END = "<think>", "</think>"


def split_reasoning(text: str, final: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of the cumulative text; unless final, a tail that may begin a marker is held
    back. An answer cut short inside its thoughts is all reasoning (so a stream's deltas join to the whole)."""
    opened = text.lstrip()
    if not opened.startswith(START):
        held = not final and START.startswith(opened)
        return None, "" if held else text
    thought = opened[len(START) :]
    end = thought.find(END)
    if end >= 0:
        return thought[:end], thought[end + len(END) :]
    if not final:
        thought = thought[
            : len(thought) - next((k for k in range(len(END) - 1, 0, -1) if thought.endswith(END[:k])), 0)
        ]
    return thought, ""


class ReasoningStream:
    """One choice's cumulative text as (new reasoning, the content so far)."""

    def __init__(self) -> None:
        self.sent = 0

    def update(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = split_reasoning(text, final)
        new, self.sent = (reasoning or "")[self.sent :], len(reasoning or "")
        return new, content
