"""OpenAI-compatible request and response models, OpenAI-style error bodies, and request -> engine inputs.

Everything a client sends is checked here, before the engine sees it: types by pydantic, values by
SamplingParams, prompts against the vocabulary and the context length. A failure is an APIError that the
server turns into {"error": {"message", "type", "param", "code"}}; messages never echo the whole input.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from frontend.inputs import prepare_prompt
from frontend.outputs import CompletionOutput, RequestOutput
from protocol.sampling import SamplingParams

MAX_ERROR_CHARS = 400
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 500: "server_error", 503: "service_unavailable_error"}
# Fields of generation_config.json that vLLM also takes as the defaults of a silent request.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop",
                   "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


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


def from_value_error(exc: ValueError) -> APIError:
    """SamplingParams says `name=value is invalid: fix`; the name becomes the error's param."""
    match = re.match(r"(\w+)=", str(exc))
    return bad_request(str(exc), param=match.group(1) if match else None)


def _loc(loc: tuple) -> str | None:
    return ".".join(str(x) for x in loc) or None


# ---- requests ------------------------------------------------------------------------------------------

class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use


class StreamOptions(_Lenient):
    include_usage: bool = False


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
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


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


def chat_prompt(messages: list[ChatMessage], tokenizer, add_generation_prompt: bool = True) -> list[int]:
    """Render the messages with the model's chat template (its own special tokens included)."""
    if not messages:
        raise bad_request("messages is empty: send at least one message", "messages")
    try:
        text = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                             tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja raises its own types (TemplateError, and whatever the template raises)
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def prepare(request_id: str, tokenizer, prompt: str | list[int], params: SamplingParams, max_model_len: int,
            vocab_size: int, param: str) -> Job:
    """The engine's own prompt checks (empty, vocabulary, context length), as 400s naming the field."""
    try:
        text, ids, params = prepare_prompt(tokenizer, prompt, params, max_model_len, vocab_size)
    except ValueError as exc:
        message = str(exc)
        code = "context_length_exceeded" if "max_model_len" in message else "invalid_value"
        raise bad_request(message, "max_tokens" if "max_tokens" in message else param, code) from None
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
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request(f"top_logprobs={req.top_logprobs} is invalid: use 0..20", "top_logprobs")
    return req.top_logprobs or 0


def sampling_params(req: _SamplingRequest, defaults: dict, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """The request's explicit fields over the model's generation defaults over SamplingParams' own."""
    explicit = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
    try:
        return SamplingParams(**{**defaults, **explicit, "max_tokens": max_tokens, "logprobs": logprobs})
    except ValueError as exc:
        raise from_value_error(exc) from None


def generation_defaults(model_dir: str | None) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json (empty when there is none)."""
    path = Path(model_dir or "") / "generation_config.json"
    if not model_dir or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in GENERATION_DEFAULT_KEYS if config.get(k) is not None}


# ---- responses ---------------------------------------------------------------------------------------------

class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and also each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- engine outputs -> responses ---------------------------------------------------------------------------

def usage(jobs: list[Job], finals: list[RequestOutput]) -> UsageInfo:
    """Prompt tokens once per prompt (not per sample); completion tokens of every sample."""
    prompt = sum(len(job.token_ids) for job in jobs)
    completion = sum(len(o.token_ids) for out in finals for o in out.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class Renderer:
    """Turns a request's engine outputs into its response, or into stream chunks of what is new.

    Choice index = prompt index * n + sample index. AsyncLLM's outputs are cumulative and their text only
    grows (stop strings are held back, never retracted), so a delta is a suffix past what was sent.
    """

    def __init__(self, response_id: str, model: str, jobs: list[Job], tokenizer):
        self.id, self.model, self.jobs, self.tokenizer = response_id, model, jobs, tokenizer
        self.created = int(time.time())
        self.n = jobs[0].params.n
        self._sent: dict[int, tuple[int, int]] = {}  # choice -> (chars, tokens) already streamed
        self._done: set[int] = set()

    def deltas(self, job: int, out: RequestOutput) -> list[tuple[int, CompletionOutput, int, int]]:
        """(choice index, output, chars sent before, tokens sent before) for each choice with news."""
        news = []
        for o in out.outputs:
            index = job * self.n + o.index
            chars, tokens = self._sent.get(index, (0, 0))
            new_tokens = o.logprobs is not None and len(o.token_ids) > tokens
            if index in self._done or not (len(o.text) > chars or o.finish_reason or new_tokens):
                continue
            news.append((index, o, chars, tokens))
            self._sent[index] = (len(o.text), len(o.token_ids))
            if o.finish_reason is not None:
                self._done.add(index)
        return news

    def logprob_rows(self, o: CompletionOutput, start: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """(token text, its logprob, top-k (text, logprob)) for the tokens from `start` on."""
        k = self.jobs[0].params.logprobs or 0
        rows = []
        for token, lps in zip(o.token_ids[start:], o.logprobs[start:]):
            top = sorted(lps.items(), key=lambda kv: kv[1], reverse=True)[:k]
            rows.append((self.tokenizer.decode([token]), lps[token], [(self.tokenizer.decode([t]), lp) for t, lp in top]))
        return rows

    def opening(self) -> list[BaseModel]:
        return []

    def chunks(self, job: int, out: RequestOutput) -> list[BaseModel]:
        raise NotImplementedError

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self, info: UsageInfo) -> BaseModel:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    def __init__(self, response_id: str, model: str, jobs: list[Job], tokenizer, echo: bool):
        super().__init__(response_id, model, jobs, tokenizer)
        self.echo = echo

    def choice(self, job: int, index: int, o: CompletionOutput, chars: int, tokens: int) -> CompletionChoice:
        prompt = self.jobs[job]
        echo = "" if not self.echo else prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)
        text = (echo if chars == tokens == 0 else "") + o.text[chars:]
        logprobs = None
        if o.logprobs is not None:
            rows = self.logprob_rows(o, tokens)
            offsets, pos = [], len(echo) + chars
            for token_text, _, _ in rows:
                offsets.append(pos)
                pos += len(token_text)
            # reversed: of top tokens that decode to the same text, the likeliest is written last and kept
            logprobs = CompletionLogprobs(tokens=[r[0] for r in rows], token_logprobs=[r[1] for r in rows],
                                          top_logprobs=[dict(reversed(r[2])) for r in rows], text_offset=offsets)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=o.finish_reason)

    def _wrap(self, choices: list[CompletionChoice], info: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=info)

    def chunks(self, job: int, out: RequestOutput) -> list[BaseModel]:
        return [self._wrap([self.choice(job, *delta)]) for delta in self.deltas(job, out)]

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        choices = [self.choice(i, i * self.n + o.index, o, 0, 0) for i, out in enumerate(finals) for o in out.outputs]
        return self._wrap(choices, usage(self.jobs, finals))

    def usage_chunk(self, info: UsageInfo) -> BaseModel:
        return self._wrap([], info)


class ChatRenderer(Renderer):
    def logprobs(self, o: CompletionOutput, start: int) -> ChatLogprobs | None:
        if o.logprobs is None:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()),
                         top_logprobs=[TopLogprob(token=t, logprob=l, bytes=list(t.encode())) for t, l in top])
            for text, lp, top in self.logprob_rows(o, start)])

    def _chunk(self, choices: list[ChatStreamChoice], info: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=info)

    def opening(self) -> list[BaseModel]:
        """OpenAI's first chunk of each choice carries the role and no content."""
        return [self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(len(self.jobs) * self.n)]

    def chunks(self, job: int, out: RequestOutput) -> list[BaseModel]:
        return [self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(content=o.text[chars:] or None),
                                              logprobs=self.logprobs(o, tokens), finish_reason=o.finish_reason)])
                for index, o, chars, tokens in self.deltas(job, out)]

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        choices = [ChatChoice(index=o.index, message=ChatMessageOut(content=o.text), logprobs=self.logprobs(o, 0),
                              finish_reason=o.finish_reason) for o in finals[0].outputs]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=usage(self.jobs, finals))

    def usage_chunk(self, info: UsageInfo) -> BaseModel:
        return self._chunk([], info)
