"""OpenAI-compatible request models, OpenAI-style error bodies, and request -> engine inputs.

Everything a client sends is checked here, before the engine sees it: types by pydantic, values by
SamplingParams, prompts against the vocabulary and the context length. A failure is an APIError that the
server turns into {"error": {"message", "type", "param", "code"}}; messages never echo the whole input.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from frontend.inputs import prepare_prompt
from protocol.config import ContextTooLong, InvalidParam
from protocol.sampling import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_ERROR_CHARS = 400
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 500: "server_error", 503: "service_unavailable_error"}
# Fields of generation_config.json that vLLM also takes as the defaults of a silent request.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
# The request fields named as SamplingParams' (each endpoint sets max_tokens and logprobs in its own way).
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name not in ("max_tokens", "logprobs"))
_NO_TOOLS = "this server does not parse tool calls: describe the tools in the prompt, or leave them out"
_NO_GUIDED = "this server has no guided decoding: ask for the format in the prompt instead"
# Fields that change what a client gets but that this server cannot honour: a 400 naming the field, never
# ignored (the client would take unconstrained text for what it asked for). Fields that change nothing
# (`user`, `metadata`) stay ignored. name -> (values served as if absent, besides null; why the rest are refused)
UNSERVED_FIELDS: dict[str, tuple[tuple, str]] = {
    "response_format": (({"type": "text"},), "json_object and json_schema need guided decoding, which this server "
                                             'does not have; only {"type": "text"} is served'),
    "tools": (([],), _NO_TOOLS),
    "functions": (([],), _NO_TOOLS),
    "tool_choice": (("none",), _NO_TOOLS + '; only "none" is served'),
    "function_call": (("none",), _NO_TOOLS + '; only "none" is served'),
    "guided_json": ((), _NO_GUIDED),
    "guided_regex": ((), _NO_GUIDED),
    "guided_choice": ((), _NO_GUIDED),
    "guided_grammar": ((), _NO_GUIDED),
    "structured_outputs": ((), _NO_GUIDED),
    "suffix": (("",), "text is not inserted before a suffix: send the prompt only"),
    "prompt_logprobs": ((), "prompt logprobs are not computed, only those of generated tokens"),
    "use_beam_search": ((False,), "beam search is not supported: ask for n samples instead"),
}


# ---- errors --------------------------------------------------------------------------------------------

class APIError(Exception):
    """A request that cannot be served, with the HTTP status and OpenAI error fields to answer it with."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = truncate(message)
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def truncate(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Cut a message so that an error body never carries a client's whole (maybe huge) input back."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first few pydantic errors as one 400; the input values themselves are left out."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    if errors and errors[0]["type"] == "json_invalid":
        return bad_request(f"request body is not valid JSON: {errors[0]['msg']}", code="invalid_json")
    parts = [f"{_loc(e['loc']) or 'body'}: {e['msg']}" for e in errors[:3]]
    more = f" (and {len(errors) - 3} more errors)" if len(errors) > 3 else ""
    param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None  # the top-level field
    return bad_request("; ".join(parts) + more, param=param, code="invalid_type")


def from_invalid_param(exc: InvalidParam, code: str = "invalid_value") -> APIError:
    return bad_request(str(exc), exc.field, "context_length_exceeded" if isinstance(exc, ContextTooLong) else code)


@contextmanager
def param_named(field: str, sent_as: str) -> Iterator[None]:
    """Errors about `field` name `sent_as` instead: the field the client sent (chat's max_completion_tokens is
    checked as max_tokens, but a client that sent max_completion_tokens must be told about that one)."""
    try:
        yield
    except APIError as exc:
        if exc.param == field and sent_as != field:
            exc.param, exc.message = sent_as, exc.message.replace(field, sent_as)
        raise


def _loc(loc: tuple) -> str | None:
    return ".".join(str(x) for x in loc) or None


# ---- requests ------------------------------------------------------------------------------------------

class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use


# OpenAI's spec makes its optional flags nullable: each flag typed `bool | None` takes null as false.
class StreamOptions(_Lenient):
    include_usage: bool | None = False


class _SamplingRequest(_Lenient):
    """Fields shared by both endpoints; None means "the client was silent", so defaults can apply."""

    model: str | None = None
    max_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # OpenAI sends the token ids as strings: pydantic makes ints
    skip_special_tokens: bool | None = None  # this and the next two: vLLM's extensions, with its defaults
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, data: object) -> object:
        """Reads the raw body: extra="ignore" would drop these fields unseen. An APIError is not a ValueError,
        so pydantic lets it through to the client as it is."""
        for name, (served, why) in UNSERVED_FIELDS.items():
            value = data.get(name) if isinstance(data, dict) else None
            if value is not None and value not in served:
                raise bad_request(f"{name} is not supported: {why}", name, code="unsupported_parameter")
        return data

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None  # only best_of <= n is served: samples are not ranked


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # "\n", as vLLM joins them: split text gives the same prompt there
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    chat_template_kwargs: dict | None = None  # vLLM's: template variables, e.g. Qwen3's {"enable_thinking": false}
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    @property
    def max_tokens_field(self) -> str:
        """The token limit's field: max_completion_tokens (OpenAI's newer name) wins when both are sent."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


def parse_request(model: type[BaseModel], body: bytes) -> BaseModel:
    """Bytes -> validated request; bad UTF-8, bad JSON and wrong types all become one 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


# ---- request -> engine inputs -----------------------------------------------------------------------------

@dataclass(slots=True)
class Job:
    """One engine request of a client's request: its prompt, ready to submit."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    text: str | None = None  # the prompt as the client wrote it (for echo); None for token ids


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The four prompt shapes of /v1/completions as a list of prompts (each one engine request)."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        return [raw]
    if not raw:
        raise bad_request("prompt is empty: send a non-empty string or list of token ids", "prompt")
    return raw


def chat_prompt(messages: list[ChatMessage], tokenizer: PreTrainedTokenizerBase,
                add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
    """Render the messages with the model's chat template (its own special tokens included)."""
    if not messages:
        raise bad_request("messages is empty: send at least one message", "messages")
    try:
        text = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                             tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except Exception as exc:  # jinja raises its own types (TemplateError, and whatever the template raises)
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def prepare(request_id: str, tokenizer: PreTrainedTokenizerBase, prompt: str | list[int], params: SamplingParams,
            max_model_len: int, vocab_size: int, prompt_field: str = "prompt") -> Job:
    """The engine's own prompt checks (empty, vocabulary, context length), as 400s naming the field (the prompt's
    is `prompt_field`: chat's is messages)."""
    try:
        text, ids = prepare_prompt(tokenizer, prompt, params, max_model_len, vocab_size)
    except InvalidParam as exc:
        error = from_invalid_param(exc)
        error.param = prompt_field if exc.field == "prompt" else exc.field
        raise error from None
    return Job(request_id, ids, params, text)


def check_stream_options(req: _SamplingRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """Chat's logprobs (bool) + top_logprobs (count) as the engine's one number of top logprobs."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if not req.logprobs:
        return None
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs={req.top_logprobs} is invalid: use 0..{MAX_LOGPROBS}", "top_logprobs")
    return req.top_logprobs or 0


def sampling_params(req: _SamplingRequest, defaults: dict, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """The request's explicit fields over the model's generation defaults over SamplingParams' own."""
    explicit = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
    try:
        return SamplingParams(**{**defaults, **explicit, "max_tokens": max_tokens, "logprobs": logprobs})
    except InvalidParam as exc:
        raise from_invalid_param(exc) from None


def generation_defaults(model_dir: str | None) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json (empty when there is none)."""
    path = Path(model_dir or "") / "generation_config.json"
    if not model_dir or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in GENERATION_DEFAULT_KEYS if config.get(k) is not None}
