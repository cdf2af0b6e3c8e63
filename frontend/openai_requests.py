"""The request bodies of OpenAI's /v1/completions and /v1/chat/completions, and of vLLM's /tokenize and
/detokenize: each request's prompts and its SamplingParams."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import PrivateAttr

from frontend.api_errors import bad_request
from frontend.api_params import LenientModel, SamplingRequest
from frontend.chat_prompt import ChatMessage, chat_prompt
from frontend.output_constraints import tool_choice_spec
from frontend.reasoning import END
from frontend.tool_formats import HERMES, ToolFormat, tool_format
from protocol.sampling import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default; chat defaults to the context


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None  # only best_of <= n is served: samples are not ranked

    def sampling_params(self, defaults: dict) -> SamplingParams:
        """echo with logprobs asks for the prompt's logprobs too; max_tokens 0 (with echo) scores the prompt only:
        the engine samples one token, which the answer leaves out."""
        if self.best_of is not None and self.best_of > (self.n or 1):
            raise bad_request(
                f"best_of={self.best_of} over n={self.n or 1} is not supported: samples are not "
                "ranked; ask for n samples instead",
                "best_of",
            )
        max_tokens = self.max_tokens if self.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        if max_tokens == 0 and not self.echo:
            raise bad_request(
                "max_tokens=0 is only served with echo=true, which returns the prompt (and its logprobs): "
                "send echo=true or ask for at least 1 token",
                "max_tokens",
            )
        params = self._params(defaults, max_tokens or 1, self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = max(self.logprobs, params.prompt_logprobs or 0)
        return params

    @property
    def prompt_only(self) -> bool:
        return bool(self.echo) and self.max_tokens == 0

    def prompts(self, tokenizer: PreTrainedTokenizerBase) -> list[str | list[int]]:
        """The four prompt shapes of /v1/completions as a list of prompts (each one engine request)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise bad_request("prompt is empty: send a non-empty string or list of token ids", "prompt")
        return self.prompt


class ToolFunction(LenientModel):
    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(LenientModel):
    type: Literal["function"]
    function: ToolFunction


class ChatCompletionRequest(SamplingRequest):
    prompt_field: ClassVar[str] = "messages"
    id_prefix: ClassVar[str] = "chatcmpl"
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = True  # vLLM's: open the assistant's turn after the messages
    continue_final_message: bool | None = False  # vLLM's: leave the last message open, for the model to go on
    chat_template_kwargs: dict | None = None  # vLLM's: template variables, e.g. Qwen3's {"enable_thinking": false}
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None  # or {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: required makes exactly one call

    # What the served model's template and the server's --reasoning-parser make of the answer (bind sets them).
    _tool_format: ToolFormat = PrivateAttr(default=HERMES)
    _shows_tools: bool = PrivateAttr(default=True)
    _reasoning_parser: str | None = PrivateAttr(default=None)

    def bind(self, tokenizer: PreTrainedTokenizerBase, reasoning_parser: str | None) -> None:
        """Read the answer in the tool format the chat template teaches; split thoughts off with the parser."""
        self._tool_format, self._shows_tools = tool_format(tokenizer.chat_template)
        self._reasoning_parser = reasoning_parser

    @property
    def tool_format(self) -> ToolFormat:
        return self._tool_format

    @property
    def reasoning_parser(self) -> str | None:
        return self._reasoning_parser

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def _tool_constraint(self) -> list[tuple[str, dict | None]]:
        tools = [t.model_dump() for t in self.tools or []]
        spec = tool_choice_spec(tools, self.tool_choice, self._tool_format, self.parallel_tool_calls is not False)
        return [("tool_choice", spec)]

    def constraint(self) -> tuple[str | None, dict | None]:
        """The output constraint; after the thoughts' end where a reasoning parser reads them, unless
        chat_template_kwargs.enable_thinking is false (the template closes an empty block in the prompt)."""
        field, spec = super().constraint()
        thinks = (self.chat_template_kwargs or {}).get("enable_thinking", True) is not False
        if spec is not None and self._reasoning_parser is not None and thinks:
            spec = {**spec, "after": END}
        return field, spec

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
        if tools and not self._shows_tools:
            if self.parses_tool_calls and self.tool_choice in (None, "auto"):
                raise bad_request(
                    "this model's chat template does not show tools to the model, so tool_choice auto would never "
                    'call one: send tool_choice "required" or a named function (a grammar writes the call)',
                    "tools",
                )
            tools = None  # required and named calls need no template; none has nothing to call
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


class TokenizeRequest(LenientModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(LenientModel):
    model: str | None = None
    tokens: list[int]
