"""The request body of Anthropic's POST /v1/messages, translated once into a chat completion request."""

from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from frontend.api_errors import bad_request
from frontend.api_params import LenientModel, joined_text
from frontend.openai_requests import ChatCompletionRequest, Tool, ToolFunction

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and {"type": "tool", "name": ...}


class TextBlock(LenientModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(LenientModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(LenientModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None  # the template shows the result as it is, error or not


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(LenientModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def chat_messages(self) -> list[dict]:
        """Tool results become tool messages before the rest of the turn; tool uses, the assistant's calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        blocks = {kind: [b for b in self.content if b.type == kind] for kind in ("text", "tool_use", "tool_result")}
        misplaced = "tool_result" if self.role == "assistant" else "tool_use"
        if blocks[misplaced]:
            raise bad_request(f"a {misplaced} block cannot be in a {self.role} message", "messages")
        out = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": joined_text(b.content)}
            for b in blocks["tool_result"]
        ]
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in blocks["tool_use"]
        ]
        if blocks["text"] or calls:
            out.append({"role": self.role, "content": [b.model_dump() for b in blocks["text"]], "tool_calls": calls})
        return out


class AnthropicTool(LenientModel):
    name: str
    description: str | None = None
    input_schema: dict

    def chat_tool(self) -> Tool:
        return Tool(
            type="function",
            function=ToolFunction(name=self.name, description=self.description, parameters=self.input_schema),
        )


class ToolChoice(LenientModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(LenientModel):
    id_prefix: ClassVar[str] = "msg"
    field_names: ClassVar[dict[str, str]] = {"stop": "stop_sequences"}  # chat's -> ours, for the errors of chat
    model: str
    max_tokens: int
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict | None = None  # a user id for Anthropic's abuse checks: nothing for this server to do
    stream: bool | None = False

    def chat_request(self) -> ChatCompletionRequest:
        system = [{"role": "system", "content": joined_text(self.system)}] if self.system else []
        tools = [t.chat_tool() for t in self.tools or []]
        return ChatCompletionRequest(
            model=self.model,
            messages=system + [m for message in self.messages for m in message.chat_messages()],
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stream=self.stream,
            tools=tools or None,
            tool_choice=self._tool_choice(),
            parallel_tool_calls=self.tool_choice is None or not self.tool_choice.disable_parallel_tool_use,
        )

    def _tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            return {"type": "function", "function": {"name": choice.name}}
        return TOOL_CHOICES[choice.type]
