"""Anthropic's Messages response, its stream events and its error body, from the chat renderer's output."""

from __future__ import annotations

import json

from frontend.api_errors import ERROR_TYPES, APIError
from frontend.block_render import Block, BlockRenderer
from frontend.output_processor import CompletionOutput, RequestOutput

# Anthropic's error types where they differ from OpenAI's
ERROR_TYPES_BY_STATUS = {**ERROR_TYPES, 413: "request_too_large", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(exc: APIError) -> dict:
    """Anthropic's error body has no param: the message names the field."""
    message = exc.message if exc.param is None or exc.param in exc.message else f"{exc.param}: {exc.message}"
    return {"type": "error", "error": {"type": ERROR_TYPES_BY_STATUS.get(exc.status, "api_error"), "message": message}}


class MessagesRenderer(BlockRenderer):
    def response(self, finals: list[RequestOutput]) -> dict:
        blocks = self.answer(finals)
        usage = self._usage(finals[0].outputs[0])
        return {**self._message([_content(b) for b in blocks]), **self._stop_reason(finals, blocks), "usage": usage}

    def opening(self) -> list[dict]:
        return [{"type": "message_start", "message": self._message([])}, {"type": "ping"}]

    def closing(self, finals: list[RequestOutput]) -> list[dict]:
        events = self.finish_blocks()
        usage = self._usage(finals[0].outputs[0])
        events.append({"type": "message_delta", "delta": self._stop_reason(finals, self.blocks), "usage": usage})
        return events + [{"type": "message_stop"}]

    def error(self, exc: APIError) -> dict:
        return anthropic_error(exc)

    def block_started(self, index: int, block: Block) -> list[dict]:
        content = {"type": "text", "text": ""}
        if block.call_id is not None:
            content = {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}
        return [{"type": "content_block_start", "index": index, "content_block": content}]

    def block_grew(self, index: int, block: Block, text: str) -> list[dict]:
        delta = {"type": "text_delta", "text": text}
        if block.call_id is not None:
            delta = {"type": "input_json_delta", "partial_json": text}
        return [{"type": "content_block_delta", "index": index, "delta": delta}]

    def block_stopped(self, index: int, block: Block) -> list[dict]:
        return [{"type": "content_block_stop", "index": index}]

    def _message(self, content: list[dict]) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self._usage(None),
        }

    def _usage(self, o: CompletionOutput | None) -> dict:
        return {"input_tokens": len(self.jobs[0].token_ids), "output_tokens": len(o.token_ids) if o else 0}

    def _stop_reason(self, finals: list[RequestOutput], blocks: list[Block]) -> dict:
        """end_turn, max_tokens, stop_sequence (with the one that matched) or tool_use."""
        o = finals[0].outputs[0]
        if o.finish_reason == "length":
            reason = "max_tokens"
        elif any(b.call_id is not None for b in blocks):
            reason = "tool_use"
        else:
            reason = "stop_sequence" if isinstance(o.stop_reason, str) else "end_turn"
        sequence = o.stop_reason if reason == "stop_sequence" else None
        return {"stop_reason": reason, "stop_sequence": sequence}


def _content(block: Block) -> dict:
    if block.call_id is None:
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": json.loads(block.text)}
