"""What every generation API's request shares: SamplingParams' fields, checked and merged over the model's
defaults, the output constraint, prompt truncation and the streaming options."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NamedTuple, get_type_hints

from pydantic import BaseModel, ConfigDict, create_model, model_validator

from frontend.api_errors import APIError, bad_request, from_invalid_param
from frontend.output_constraints import one_constraint, response_format_spec
from protocol.config import InvalidParam
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Fields of generation_config.json that vLLM also takes as the defaults of a silent request.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
# The request fields named as SamplingParams' (each endpoint sets max_tokens and logprobs in its own way).
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name not in ("max_tokens", "logprobs"))
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_NO_FUNCTIONS = "the deprecated functions API is not served: send tools and tool_choice instead"
# Fields this server cannot honour are refused with a 400, never ignored (the client would take unconstrained
# text for what it asked for). name -> (values served as if absent, besides null; why the rest are refused)
UNSERVED_FIELDS: dict[str, tuple[tuple, str]] = {
    "functions": (([],), _NO_FUNCTIONS),
    "function_call": (("none",), _NO_FUNCTIONS),
    "suffix": (("",), "text is not inserted before a suffix: send the prompt only"),
    "use_beam_search": ((False,), "beam search is not supported: ask for n samples instead"),
}


class Job(NamedTuple):
    """One engine request of a client's request: its prompt, ready to submit."""

    request_id: str
    text: str | None  # the prompt as the client wrote it (for echo); None for token ids
    token_ids: list[int]
    params: SamplingParams


class LenientModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use


def joined_text(content: str | list) -> str:
    """A message's text parts joined by "\n", as vLLM joins them: split text gives the same prompt there."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def refuse_unserved(data: object, unserved: dict[str, tuple[tuple, str]]) -> object:
    """A before-validator's check of the raw body, as extra="ignore" drops these unseen; an APIError passes
    pydantic to the client."""
    for name, (served, why) in unserved.items():
        value = data.get(name) if isinstance(data, dict) else None
        if value is not None and value not in served:
            raise bad_request(f"{name} is not supported: {why}", name, code="unsupported_parameter")
    return data


# OpenAI's spec makes its optional flags nullable: each flag typed `bool | None` takes null as false.
class StreamOptions(LenientModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk carries usage so far


# SamplingParams' fields, each None when the client is silent (so that the model's defaults can apply).
_SamplingFields = create_model(
    "_SamplingFields",
    __base__=LenientModel,
    **{name: (hint | None, None) for name, hint in get_type_hints(SamplingParams).items() if name in SAMPLING_FIELDS},
)


class SamplingRequest(_SamplingFields):
    """A request that generates: each API's request model adds its prompt and its way to count tokens."""

    prompt_field: ClassVar[str] = "prompt"
    max_tokens_field: ClassVar[str] = "max_tokens"
    id_prefix: ClassVar[str] = "cmpl"
    parses_tool_calls: ClassVar[bool] = False  # whether the answer is parsed for tool calls (chat with tools)
    prompt_only: ClassVar[bool] = False  # whether the answer is the prompt alone (completions' echo, max_tokens 0)
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
        return refuse_unserved(data, UNSERVED_FIELDS)

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they would all come in one chunk
            raise bad_request("prompt_logprobs is not served with stream=true: send stream=false", "prompt_logprobs")
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
        keep = max_model_len if k == -1 else k
        return [(tokenizer.encode(p) if isinstance(p, str) else p)[-keep:] for p in prompts]

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
            (name, None if getattr(self, name) is None else {name.removeprefix("guided_"): getattr(self, name)})
            for name in GUIDED_FIELDS
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

    def bind(self, tokenizer: PreTrainedTokenizerBase, reasoning_parser: str | None) -> None:
        """What the served model makes of the answer: only chat parses it (tool calls, thoughts)."""


def generation_defaults(model_dir: str | None) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json (empty when there is none)."""
    path = Path(model_dir or "") / "generation_config.json"
    config = json.loads(path.read_text()) if model_dir and path.is_file() else {}
    return {k: config[k] for k in GENERATION_DEFAULT_KEYS if config.get(k) is not None}
