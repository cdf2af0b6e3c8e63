"""OpenAI's Responses object and its stream events (numbered), from the chat renderer's output."""

from __future__ import annotations

from frontend.api_errors import APIError
from frontend.block_render import Block, BlockRenderer
from frontend.output_processor import RequestOutput
from frontend.responses_requests import ResponsesRequest


class ResponsesRenderer(BlockRenderer):
    front: ResponsesRequest  # what the response object repeats of the request

    def __init__(self, *args, front: ResponsesRequest) -> None:
        super().__init__(*args, front=front)
        self.sequence = 0  # every stream event's sequence_number

    def response(self, finals: list[RequestOutput]) -> dict:
        return self._response([_item(b, "completed") for b in self.answer(finals)], finals)

    def opening(self) -> list[dict]:
        response = self._response([], None)
        return [
            {"type": "response.created", "response": response},
            {"type": "response.in_progress", "response": response},
        ]

    def closing(self, finals: list[RequestOutput]) -> list[dict]:
        events = self.finish_blocks()
        response = self._response([_item(b, "completed") for b in self.blocks], finals)
        return events + [{"type": f"response.{response['status']}", "response": response}]

    def event(self, chunk: dict) -> str:
        self.sequence += 1
        return super().event({**chunk, "sequence_number": self.sequence - 1})

    def error(self, exc: APIError) -> dict:
        return {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}

    def block_started(self, index: int, block: Block) -> list[dict]:
        item = _item(block, "in_progress")
        events = [{"type": "response.output_item.added", "output_index": index, "item": item}]
        if block.call_id is None:
            part = {"item_id": item["id"], "output_index": index, "content_index": 0, "part": _part("")}
            events.append({"type": "response.content_part.added", **part})
        return events

    def block_grew(self, index: int, block: Block, text: str) -> list[dict]:
        where = {"item_id": _item_id(block), "output_index": index}
        if block.call_id is not None:
            return [{"type": "response.function_call_arguments.delta", **where, "delta": text}]
        return [{"type": "response.output_text.delta", **where, "content_index": 0, "delta": text, "logprobs": []}]

    def block_stopped(self, index: int, block: Block) -> list[dict]:
        where = {"item_id": _item_id(block), "output_index": index}
        if block.call_id is not None:
            events = [
                {"type": "response.function_call_arguments.done", **where, "name": block.name, "arguments": block.text}
            ]
        else:
            where["content_index"] = 0
            events = [
                {"type": "response.output_text.done", **where, "text": block.text, "logprobs": []},
                {"type": "response.content_part.done", **where, "part": _part(block.text)},
            ]
        return events + [
            {"type": "response.output_item.done", "output_index": index, "item": _item(block, "completed")}
        ]

    def _response(self, output: list[dict], finals: list[RequestOutput] | None) -> dict:
        front, params = self.front, self.jobs[0].params
        status = "in_progress"
        if finals is not None:
            status = "incomplete" if finals[0].outputs[0].finish_reason == "length" else "completed"
        fmt = front.text.format if front.text is not None and front.text.format is not None else None
        choice = front.tool_choice or "auto"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": front.instructions,
            "max_output_tokens": front.max_output_tokens,
            "metadata": front.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": front.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": params.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in front.tools or []],
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": self._usage(finals) if finals is not None else None,
        }

    def _usage(self, finals: list[RequestOutput]) -> dict:
        usage = self.usage(finals)
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }


def _item_id(block: Block) -> str:
    return f"{'msg' if block.call_id is None else 'fc'}_{block.id}"


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(block: Block, status: str) -> dict:
    """An output item: the assistant's message (its text as one part), or a function call."""
    if block.call_id is not None:
        return {
            "type": "function_call",
            "id": _item_id(block),
            "call_id": block.call_id,
            "name": block.name,
            "arguments": block.text,
            "status": status,
        }
    content = [_part(block.text)] if status == "completed" else []
    return {"type": "message", "id": _item_id(block), "status": status, "role": "assistant", "content": content}
