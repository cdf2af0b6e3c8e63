"""Tool calls in Llama 3's JSON format, as vLLM's llama3_json parser reads them: the whole answer is one or more
`{"name": ..., "parameters": {...}}` objects ("arguments" also), separated by ";", optionally after <|python_tag|>.

Also the format of required and named tool_choice on a chat template that shows no tools: the grammar writes it."""

from __future__ import annotations

import json
import re

from frontend.tool_calls import call_deltas, call_id, calls_grammar, same_json

PYTHON_TAG = "<|python_tag|>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*')
_SEPARATOR = re.compile(r"\s*;\s*")
_SPACES = re.compile(r"\s*")
_CLOSE = re.compile(r"\s*\}")
_DECODER = json.JSONDecoder()


def llama_tool_grammar(tools: list[dict], names: list[str], only_one: bool) -> dict:
    """structured_outputs for calls of the named tools only: at least one object (exactly one if only_one)."""
    return calls_grammar(tools, names, only_one, lambda name: f'{{"name": {name}, "parameters": ', "}", "; ")


def _body(text: str) -> str:
    return text.lstrip().removeprefix(PYTHON_TAG)


def _whole_call(obj: object) -> tuple[str, dict] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return (obj["name"], args) if isinstance(args, dict) else None


def parse_llama_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole answer: calls only if the whole answer is calls, else all content."""
    body, pos, calls = _body(text), 0, []
    while True:
        start = _SPACES.match(body, pos).end()
        try:
            obj, pos = _DECODER.raw_decode(body, start)
        except ValueError:
            return text or None, []
        call = _whole_call(obj)
        if call is None:
            return text or None, []
        calls.append(_call(*call, body[start:pos]))
        end = _SPACES.match(body, pos).end()
        if end == len(body):
            return None, calls
        if body[end] != ";":
            return text or None, []
        pos = end + 1


def _call(name: str, args: dict, raw_object: str) -> dict:
    raw = _raw_arguments(raw_object)
    text = raw[0] if raw and same_json(raw[0], args) else json.dumps(args, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def _raw_arguments(body: str) -> tuple[str, int] | None:
    """(the arguments' own text, the index past it) of a complete object in its usual key order, else None."""
    head = _HEAD.match(body)
    if head is None:
        return None
    try:
        _, end = _DECODER.raw_decode(body, head.end())
    except ValueError:
        return None
    return body[head.end() : end], end


def _streamed_calls(body: str) -> list[tuple[str, str]]:
    """(name, the arguments' text so far) of each call begun in a partial answer; an open call holds back its last
    '}' and the whitespace before it: they may close the call, not the arguments."""
    calls, pos = [], 0
    while (head := _HEAD.match(body, pos)) is not None:
        done = _raw_arguments(body[pos:])
        if done is None:
            rest = body[head.end() :]
            cut = rest.rfind("}")
            calls.append((json.loads(head.group(1)), rest[: cut if cut >= 0 else len(rest)].rstrip()))
            return calls
        calls.append((json.loads(head.group(1)), done[0]))
        close = _CLOSE.match(body, pos + done[1])
        separator = _SEPARATOR.match(body, close.end()) if close else None
        if separator is None or separator.end() == close.end():
            return calls
        pos = separator.end()
    return calls


class LlamaToolCallStream:
    """One choice's cumulative text as OpenAI deltas: the answer is content, or calls (each its id, type and name
    once, then fragments of its arguments). Text that may still begin a call is held back."""

    def __init__(self) -> None:
        self.content_sent = 0
        self.sent: dict[int, int] = {}  # call index -> its arguments' chars sent

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(new content, tool-call deltas) since the last update."""
        body = _body(text)
        calls = _streamed_calls(body) if not self.content_sent else []
        if not calls:
            undecided = not body.strip() or body.lstrip().startswith("{") or PYTHON_TAG.startswith(text.lstrip())
            if self.sent or (undecided and not final):
                return "", []
            new, self.content_sent = text[self.content_sent :], len(text)
            return new, []
        deltas = []
        for index, (name, args) in enumerate(calls):
            sent = self.sent.get(index)
            deltas += call_deltas(index, name, args, sent)
            self.sent[index] = max(len(args), sent or 0)
        return "", deltas

    @property
    def called(self) -> bool:
        return bool(self.sent)
