"""The request body of OpenAI's POST /v1/responses, served stateless: translated once into a chat completion
request. What needs stored state or built-in tools is refused, naming the field."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from frontend.api_errors import bad_request
from frontend.api_params import LenientModel, joined_text, refuse_unserved
from frontend.openai_requests import ChatCompletionRequest, Tool, ToolFunction

_STATELESS = "responses are not stored: send the whole conversation in input"
UNSERVED_FIELDS: dict[str, tuple[tuple, str]] = {
    "previous_response_id": ((), _STATELESS),
    "conversation": ((), _STATELESS),
    "prompt": ((), "stored prompt templates are not served: send instructions and input"),
    "background": ((False,), "background responses are not served: wait for the response or stream it"),
}
ROLES = {"developer": "system"}  # the chat templates know system messages only


class TextPart(LenientModel):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(LenientModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(LenientModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(LenientModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


def _item_type(item: object) -> str:
    """A message item may leave out its type."""
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(LenientModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # the grammar enforces the schema whenever a call is forced


class FunctionChoice(LenientModel):
    type: Literal["function"]
    name: str


class TextFormat(LenientModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(LenientModel):
    format: TextFormat | None = None


class ResponsesRequest(LenientModel):
    id_prefix: ClassVar[str] = "resp"
    # chat's field -> ours, for the errors of the translated request
    field_names: ClassVar[dict[str, str]] = {
        "messages": "input",
        "max_tokens": "max_output_tokens",
        "response_format": "text.format",
    }
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None  # nothing is stored, whatever is asked: the response says store false
    metadata: dict | None = None
    stream: bool | None = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, data: object) -> object:
        tools = data.get("tools") if isinstance(data, dict) else None
        kinds = [t.get("type") for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
        builtin = next((kind for kind in kinds if kind != "function"), None)
        if builtin is not None:
            raise bad_request(
                f"tools: the built-in tool {builtin!r} is not served: send function tools only",
                "tools",
                code="unsupported_parameter",
            )
        return refuse_unserved(data, UNSERVED_FIELDS)

    def chat_request(self) -> ChatCompletionRequest:
        if not self.input:
            raise bad_request("input is empty: send a string or at least one item", "input")
        tools = [Tool(type="function", function=ToolFunction(**t.model_dump())) for t in self.tools or []]
        # A forced call has no text for text.format to shape: the tools' grammar constrains alone.
        return ChatCompletionRequest(
            model=self.model,
            messages=self._messages(),
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            tools=tools or None,
            tool_choice=self._tool_choice(),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format() if self.tool_choice in (None, "auto", "none") else None,
        )

    def _messages(self) -> list[dict]:
        """Items as chat messages: function calls join the assistant message before them."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if item.type == "message":
                messages.append({"role": ROLES.get(item.role, item.role), "content": joined_text(item.content)})
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": joined_text(item.output)})
            else:
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": ""})
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                messages[-1].setdefault("tool_calls", []).append(call)
        return messages

    def _tool_choice(self) -> str | dict | None:
        if isinstance(self.tool_choice, FunctionChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def _response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return None
        if fmt.type == "json_schema":
            return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
        return {"type": fmt.type}
