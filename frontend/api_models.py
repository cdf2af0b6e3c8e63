"""OpenAI-compatible requests, checked before the engine sees them, and OpenAI-style error bodies."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator

from frontend.output_constraints import one_constraint, response_format_spec, tool_choice_spec
from frontend.tool_calls import OPEN
from protocol.config import ContextTooLong, InvalidParam
from protocol.sampling import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_ERROR_CHARS = 400
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}
# Fields of generation_config.json that vLLM also takes as the defaults of a silent request.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
# The request fields named as SamplingParams' (each endpoint sets max_tokens and logprobs in its own way).
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name not in ("max_tokens", "logprobs"))
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default; chat defaults to the context
_NO_FUNCTIONS = "the deprecated functions API is not served: send tools and tool_choice instead"
# Fields this server cannot honour are refused with a 400, never ignored (the client would take unconstrained
# text for what it asked for). name -> (values served as if absent, besides null; why the rest are refused)
UNSERVED_FIELDS: dict[str, tuple[tuple, str]] = {
    "functions": (([],), _NO_FUNCTIONS),
    "function_call": (("none",), _NO_FUNCTIONS),
    "suffix": (("",), "text is not inserted before a suffix: send the prompt only"),
    "prompt_logprobs": ((), "prompt logprobs are not computed, only those of generated tokens"),
    "use_beam_search": ((False,), "beam search is not supported: ask for n samples instead"),
}


class APIError(Exception):
    """A request that cannot be served, with the HTTP status and OpenAI error fields to answer it with."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        cut = len(message) - MAX_ERROR_CHARS  # an error body never carries a client's whole input back
        self.message = message if cut <= 0 else message[:MAX_ERROR_CHARS] + f"... ({cut} more characters)"

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_invalid_param(
    exc: InvalidParam, prompt_field: str = "prompt", max_tokens_field: str = "max_tokens"
) -> APIError:
    """A 400 naming the field the client sent (chat: messages, maybe max_completion_tokens)."""
    message, field = str(exc), {"prompt": prompt_field, "max_tokens": max_tokens_field}.get(exc.field, exc.field)
    if exc.field == "max_tokens":
        message = message.replace("max_tokens", max_tokens_field)
    return bad_request(
        message, field, "context_length_exceeded" if isinstance(exc, ContextTooLong) else "invalid_value"
    )


def parse_request(model: type[BaseModel], body: bytes) -> BaseModel:
    """Bytes -> validated request; bad UTF-8, bad JSON and wrong types all become one 400 (the inputs left out)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
    if errors and errors[0]["type"] == "json_invalid":
        raise bad_request(f"request body is not valid JSON: {errors[0]['msg']}", code="invalid_json")
    parts = [f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in errors[:3]]
    more = f" (and {len(errors) - 3} more errors)" if len(errors) > 3 else ""
    param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None  # the top-level field
    raise bad_request("; ".join(parts) + more, param=param, code="invalid_type")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use


# OpenAI's spec makes its optional flags nullable: each flag typed `bool | None` takes null as false.
class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk carries usage so far


# SamplingParams' fields, each None when the client is silent (so that the model's defaults can apply).
_SamplingFields = create_model(
    "_SamplingFields",
    __base__=_Lenient,
    **{name: (hint | None, None) for name, hint in get_type_hints(SamplingParams).items() if name in SAMPLING_FIELDS},
)


class _SamplingRequest(_SamplingFields):
    prompt_field: ClassVar[str] = "prompt"
    max_tokens_field: ClassVar[str] = "max_tokens"
    id_prefix: ClassVar[str] = "cmpl"
    parses_tool_calls: ClassVar[bool] = False  # whether the answer is parsed for tool calls (chat with tools)
    model: str | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the last k prompt tokens (-1: max_model_len)
    return_tokens_as_token_ids: bool | None = False  # vLLM's: logprob tokens as "token_id:N"
    response_format: dict | None = None
    guided_json: dict | str | None = None  # vLLM's older names of structured_outputs' json, regex, choice, grammar
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, data: object) -> object:
        """Reads the raw body, as extra="ignore" drops these unseen; an APIError passes pydantic to the client."""
        for name, (served, why) in UNSERVED_FIELDS.items():
            value = data.get(name) if isinstance(data, dict) else None
            if value is not None and value not in served:
                raise bad_request(f"{name} is not supported: {why}", name, code="unsupported_parameter")
        return data

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def truncated(
        self, prompts: list[str | list[int]], tokenizer: PreTrainedTokenizerBase, max_model_len: int
    ) -> list[str | list[int]]:
        """vLLM's truncate_prompt_tokens: each prompt's last k tokens (left truncation; -1 means max_model_len)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompts
        if not (k == -1 or 1 <= k <= max_model_len):
            raise bad_request(
                f"truncate_prompt_tokens={k} is invalid: use 1..{max_model_len} (max_model_len), or "
                "-1 for max_model_len",
                "truncate_prompt_tokens",
            )
        return [
            (tokenizer.encode(p) if isinstance(p, str) else p)[-(max_model_len if k == -1 else k) :] for p in prompts
        ]

    def _params(self, defaults: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request's explicit fields over the model's generation defaults over SamplingParams' own."""
        explicit = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        try:
            explicit["structured_outputs"] = self.constraint()[1]
            return SamplingParams(**{**defaults, **explicit, "max_tokens": max_tokens, "logprobs": logprobs})
        except InvalidParam as exc:
            raise self.invalid(exc) from None

    def invalid(self, exc: InvalidParam) -> APIError:
        """A 400 naming the field the client sent (a constraint's own field, e.g. guided_regex)."""
        field = self.constraint()[0] if exc.field == "structured_outputs" else None
        if field is not None and field != exc.field:
            return bad_request(f"{field}: {exc}", field)
        return from_invalid_param(exc, max_tokens_field=self.max_tokens_field)

    def constraint(self) -> tuple[str | None, dict | None]:
        """(the field that asked, as structured_outputs) of the one output constraint the request sends."""
        guided = [
            (name, None if getattr(self, name) is None else {name[len("guided_") :]: getattr(self, name)})
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        ]
        return one_constraint(
            [
                ("structured_outputs", self.structured_outputs),
                ("response_format", response_format_spec(self.response_format)),
                *guided,
                *self._tool_constraint(),
            ]
        )

    def _tool_constraint(self) -> list[tuple[str, dict | None]]:
        return []


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None  # only best_of <= n is served: samples are not ranked

    def sampling_params(self, defaults: dict) -> SamplingParams:
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported: prompt logprobs are not computed", "echo")
        if self.best_of is not None and self.best_of > (self.n or 1):
            raise bad_request(
                f"best_of={self.best_of} over n={self.n or 1} is not supported: samples are not "
                "ranked; ask for n samples instead",
                "best_of",
            )
        max_tokens = self.max_tokens if self.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        return self._params(defaults, max_tokens, self.logprobs)

    def prompts(self, tokenizer: PreTrainedTokenizerBase) -> list[str | list[int]]:
        """The four prompt shapes of /v1/completions as a list of prompts (each one engine request)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise bad_request("prompt is empty: send a non-empty string or list of token ids", "prompt")
        return self.prompt


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ToolFunction(_Lenient):
    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: ToolFunction


class ChatMessage(_Lenient):
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
        if isinstance(self.content, list):  # "\n", as vLLM joins them: split text gives the same prompt there
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    prompt_field: ClassVar[str] = "messages"
    id_prefix: ClassVar[str] = "chatcmpl"
    echo: ClassVar[bool] = False  # the prompt is never echoed in a chat
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = True  # vLLM's: open the assistant's turn after the messages
    continue_final_message: bool | None = False  # vLLM's: leave the last message open, for the model to go on
    chat_template_kwargs: dict | None = None  # vLLM's: template variables, e.g. Qwen3's {"enable_thinking": false}
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None  # or {"type": "function", ...}

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def _tool_constraint(self) -> list[tuple[str, dict | None]]:
        return [("tool_choice", tool_choice_spec([t.model_dump() for t in self.tools or []], self.tool_choice))]

    @property
    def max_tokens_field(self) -> str:
        """max_completion_tokens (OpenAI's newer name) wins when both are sent."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling_params(self, defaults: dict) -> SamplingParams:
        """logprobs (bool) and top_logprobs (count) become the engine's one number of top logprobs."""
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.logprobs and self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs={self.top_logprobs} is invalid: use 0..{MAX_LOGPROBS}", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(defaults, getattr(self, self.max_tokens_field), logprobs)

    def prompts(self, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
        # tool_choice "none" still shows the tools (as OpenAI and vLLM do); the answer is then not parsed for calls.
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []] or None
        if tools and OPEN not in (tokenizer.chat_template or ""):
            if self.parses_tool_calls:
                raise bad_request(
                    "tools are served in Qwen's <tool_call> format, which this model's chat template "
                    "does not use (Qwen2.5 and Qwen3 do; Llama 3 does not): leave tools out",
                    "tools",
                )
            tools = None  # tool_choice "none" on a template that cannot show them: nothing to call anyway
        return [
            chat_prompt(
                self.messages,
                tokenizer,
                self.add_generation_prompt is not False,
                bool(self.continue_final_message),
                self.chat_template_kwargs,
                tools,
            )
        ]


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


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


class Job(NamedTuple):
    """One engine request of a client's request: its prompt, ready to submit."""

    request_id: str
    text: str | None  # the prompt as the client wrote it (for echo); None for token ids
    token_ids: list[int]
    params: SamplingParams


def generation_defaults(model_dir: str | None) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json (empty when there is none)."""
    path = Path(model_dir or "") / "generation_config.json"
    config = json.loads(path.read_text()) if model_dir and path.is_file() else {}
    return {k: config[k] for k in GENERATION_DEFAULT_KEYS if config.get(k) is not None}
