"""Tool calls in Qwen's format: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.

The grammar that enforces `required` and a named tool_choice, and the parser that turns the model's text into
OpenAI tool calls, whole or as stream deltas (a call's name first, then fragments of its arguments' own text)."""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def tool_grammar(tools: list[dict], names: list[str], only_one: bool) -> dict:
    """structured_outputs for calls of the named tools only: at least one block (exactly one if only_one)."""
    return calls_grammar(
        tools, names, only_one, lambda name: f'{OPEN}\n{{"name": {name}, "arguments": ', "}\n" + CLOSE, "\n"
    )


def calls_grammar(tools: list[dict], names: list[str], only_one: bool, begin, end: str, separator: str) -> dict:
    """A structural tag of calls of the named tools, each begin(its name as JSON), its arguments' schema, end."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    tags = [
        {
            "type": "tag",
            "begin": begin(json.dumps(name)),
            "content": {"type": "json_schema", "json_schema": params[name], "max_whitespace_cnt": 1},
            "end": end,
        }
        for name in names
    ]
    fmt = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": only_one,
    }
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}


def _split(text: str, final: bool) -> tuple[list[str], list[tuple[str, bool]]]:
    """Text outside the blocks, and each block's body with whether it is closed. Unless final, a tail that may
    begin a block is held back."""
    content, blocks, pos = [], [], 0
    while (start := text.find(OPEN, pos)) >= 0:
        content.append(text[pos:start])
        end = text.find(CLOSE, start)
        if end < 0:
            blocks.append((text[start + len(OPEN) :], False))
            return content, blocks
        blocks.append((text[start + len(OPEN) : end], True))
        pos = end + len(CLOSE)
    tail = text[pos:]
    if not final:
        tail = tail[: len(tail) - next((k for k in range(len(OPEN) - 1, 0, -1) if tail.endswith(OPEN[:k])), 0)]
    content.append(tail)
    return content, blocks


def _call(body: str, closed: bool) -> tuple[str | None, str, bool]:
    """(name or None while unknown, the arguments' text so far, whether the block is a valid call). An open
    block holds back its last '}' and the whitespace before it: they may close the call, not the arguments."""
    head = _HEAD.match(body)
    if closed:
        try:
            call = json.loads(body)
            name, args = call["name"], call["arguments"]
        except (ValueError, TypeError, KeyError):
            return None, "", False
        if not (isinstance(name, str) and isinstance(args, dict) and len(call) == 2):
            return None, "", False
        raw = body[head.end() : body.rstrip().rindex("}")].rstrip() if head else ""
        return name, (raw if head and same_json(raw, args) else json.dumps(args, ensure_ascii=False)), True
    if head is None:
        return None, "", True
    rest = body[head.end() :]
    cut = rest.rfind("}")
    return json.loads(head.group(1)), rest[: cut if cut >= 0 else len(rest)].rstrip(), True


def same_json(raw: str, value: object) -> bool:
    try:
        return json.loads(raw) == value
    except ValueError:
        return False


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_deltas(index: int, name: str, args: str, sent: int | None) -> list[dict]:
    """A streamed call's new deltas: its id, type and name first (sent None: none yet), then its arguments past sent."""
    head = {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
    deltas = [head] if sent is None else []
    if len(args) > (sent or 0):
        deltas.append({"index": index, "function": {"arguments": args[sent or 0 :]}})
    return deltas


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole answer; a block that is not a valid call stays in the content."""
    content, blocks = _split(text, final=True)
    pieces, calls = [content[0]], []
    for i, (body, closed) in enumerate(blocks):
        name, args, valid = _call(body, closed)
        if closed and valid:
            calls.append({"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}})
        else:
            pieces.append(OPEN + body + (CLOSE if closed else ""))
        pieces.extend(content[i + 1 : i + 2])
    return "".join(pieces).strip() or None, calls


class ToolCallStream:
    """One choice's cumulative text as OpenAI deltas: content, then per call its id, type and name once, then
    fragments of its arguments; joined, the fragments are the whole answer's arguments."""

    def __init__(self) -> None:
        self.content_sent = 0
        self.slots: dict[int, tuple[int, int | None]] = {}  # block index -> (call index, arguments' chars sent)

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(new content, tool-call deltas) since the last update."""
        content, blocks = _split(text, final)
        pieces, deltas = [content[0]], []
        for i, (body, closed) in enumerate(blocks):
            name, args, valid = _call(body, closed)
            if i not in self.slots and not valid:  # never began as a call: its text is content
                pieces.append(OPEN + body + CLOSE)
            elif name is not None:
                index, sent = self.slots.setdefault(i, (len(self.slots), None))
                deltas += call_deltas(index, name, args, sent)
                self.slots[i] = (index, max(len(args), sent or 0))
            pieces.extend(c for c in content[i + 1 : i + 2] if c.strip())  # no lone newlines between calls
        text_out = "".join(pieces)
        new, self.content_sent = text_out[self.content_sent :], len(text_out)
        return new, deltas

    @property
    def called(self) -> bool:
        return bool(self.slots)
