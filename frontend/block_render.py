"""A chat answer as content blocks (its text, then one block per tool call), for the APIs whose streams open,
grow and close each block: Anthropic's Messages and OpenAI's Responses. Each renders the chat renderer's output."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from frontend.api_params import LenientModel
from frontend.api_render import ChatRenderer
from frontend.output_processor import RequestOutput


@dataclass(slots=True)
class Block:
    """The answer's text (call_id None), or a tool call whose text is its arguments' JSON."""

    call_id: str | None = None
    name: str | None = None
    text: str = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


class BlockRenderer(ChatRenderer):
    """One choice (these APIs have no n); its chat deltas become block events, named by their type: a subclass
    renders each with block_started(index, block), block_grew(index, block, text) and block_stopped(index, block)."""

    done = None  # the stream ends with the API's own last event

    def __init__(self, *args, front: LenientModel) -> None:
        super().__init__(*args)
        self.front = front  # the API's own request, before its translation to chat
        self.blocks: list[Block] = []  # streamed so far; the last one is open while self.open
        self.open = False

    def event(self, chunk: dict) -> str:
        return f"event: {chunk['type']}\ndata: {json.dumps(chunk)}\n\n"

    def answer(self, finals: list[RequestOutput]) -> list[Block]:
        """The whole answer's blocks: its text (also when empty, if there is no call), then its calls."""
        message = super().response(finals)["choices"][0]["message"]
        calls = message.get("tool_calls", [])
        text = [Block(text=message["content"] or "")] if message["content"] or not calls else []
        return text + [Block(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]

    def chunks(self, job: int, out: RequestOutput) -> list[dict]:
        events = []
        for chunk in super().chunks(job, out):
            delta = chunk["choices"][0]["delta"]
            if delta["content"]:
                if not (self.open and self.blocks[-1].call_id is None):
                    events += self._start(Block())
                events += self._grow(delta["content"])
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    events += self._start(Block(call["id"], call["function"]["name"]))
                if call["function"]["arguments"]:
                    events += self._grow(call["function"]["arguments"])
        return events

    def finish_blocks(self) -> list[dict]:
        """Close the open block; an answer that streamed nothing gets its empty text block, as answer() does."""
        return (self._start(Block()) if not self.blocks else []) + self._stop()

    def _start(self, block: Block) -> list[dict]:
        events = self._stop()
        self.blocks.append(block)
        self.open = True
        return events + self.block_started(len(self.blocks) - 1, block)

    def _grow(self, text: str) -> list[dict]:
        self.blocks[-1].text += text
        return self.block_grew(len(self.blocks) - 1, self.blocks[-1], text)

    def _stop(self) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        return self.block_stopped(len(self.blocks) - 1, self.blocks[-1])
