"""Chat messages as the model's chat template reads them, rendered into the prompt's token ids."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Literal

from frontend.api_errors import bad_request
from frontend.api_params import LenientModel, joined_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextPart(LenientModel):
    type: Literal["text"]
    text: str


class ChatMessage(LenientModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls: OpenAI's shape, arguments as a JSON string
    tool_call_id: str | None = None

    def rendered(self) -> dict:
        """The message as chat templates read it: a call's arguments as a map (Qwen2.5's template writes tojson)."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [_parsed_arguments(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        return joined_text(self.content or "")


def _parsed_arguments(call: dict) -> dict:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        except ValueError:
            pass
    return call


def chat_prompt(
    messages: list[ChatMessage],
    tokenizer: PreTrainedTokenizerBase,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """Render the messages with the model's chat template (its own special tokens included)."""
    if not messages:
        raise bad_request("messages is empty: send at least one message", "messages")
    if add_generation_prompt and continue_final_message:
        raise bad_request(
            "continue_final_message=true needs add_generation_prompt=false: the model either goes on "
            "with the last message or starts a new one",
            "continue_final_message",
        )
    try:
        text = tokenizer.apply_chat_template(
            [m.rendered() for m in messages],
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # jinja raises its own types (TemplateError, and whatever the template raises)
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)
