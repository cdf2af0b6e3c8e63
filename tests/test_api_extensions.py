"""The OpenAI API's request handling and output rules, without a server: what vLLM's users rely on."""
from __future__ import annotations

import json

import pytest

from frontend.api_models import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from frontend.output_processor import OutputProcessor
from frontend.outputs import CompletionOutput
from protocol.messages import TokenBatch, i32
from protocol.sampling import SamplingParams


class ByteTokenizer:
    """A byte-level vocabulary small enough to read: a token is its bytes; a split character decodes as U+FFFD."""

    PIECES = {0: b"<s>", 1: b"ab", 2: b"c\xf0\x9f", 3: b"\xa6\x80", 4: b"<|end|>", 5: b" x"}
    SPECIAL = {0, 4}

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **kw) -> str:
        kept = [i for i in ids if not (skip_special_tokens and i in self.SPECIAL)]
        return b"".join(self.PIECES[i] for i in kept).decode("utf-8", errors="replace")


def generate(params: SamplingParams, steps: list[tuple[int, str | None]]) -> CompletionOutput:
    """Feed one sample's engine tokens (and finish reasons) through the OutputProcessor; its output."""
    processor = OutputProcessor(ByteTokenizer())
    state, (msg,) = processor.add("r", None, [0], params)
    for token, reason in steps:
        processor.process(TokenBatch(0, [msg.request_id], i32([token]), {msg.request_id: reason} if reason else {}))
    return state.output.outputs[0]


def test_chat_content_parts_are_joined_with_newlines_like_vllm():
    req = parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": '
                                               b'[{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]}')
    assert req.messages[0].text() == "one\ntwo"


def test_stop_string_completed_by_the_last_token_of_a_split_character_finishes_with_stop():
    # "c" arrives with the first bytes of a 4-byte character in one token; the request ends (length) before the
    # rest, so the stop string is only seen when the held-back text is flushed.
    out = generate(SamplingParams(max_tokens=2, stop=["c"]), [(1, None), (2, "length")])
    assert (out.text, out.finish_reason, out.stop_reason) == ("ab", "stop", "c")
    whole = generate(SamplingParams(max_tokens=3, stop=["c"]), [(1, None), (2, None), (3, "length")])
    assert (whole.text, whole.finish_reason, whole.stop_reason) == ("ab", "stop", "c")


CHAT_BODY = {"messages": [{"role": "user", "content": "Hi"}]}
COMPLETION_BODY = {"prompt": "Hi"}
UNSERVED = [  # (request model, field, a value that would change what the client gets)
    (ChatCompletionRequest, "response_format", {"type": "json_object"}),
    (ChatCompletionRequest, "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    (CompletionRequest, "response_format", {"type": "json_object"}),
    (ChatCompletionRequest, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (ChatCompletionRequest, "tool_choice", "auto"),
    (ChatCompletionRequest, "tool_choice", {"type": "function", "function": {"name": "f"}}),
    (ChatCompletionRequest, "functions", [{"name": "f", "parameters": {}}]),
    (ChatCompletionRequest, "function_call", "auto"),
    (CompletionRequest, "guided_json", {"type": "object"}),
    (ChatCompletionRequest, "guided_regex", "[a-z]+"),
    (ChatCompletionRequest, "guided_choice", ["yes", "no"]),
    (CompletionRequest, "guided_grammar", "root ::= 'a'"),
    (ChatCompletionRequest, "structured_outputs", {"choice": ["yes", "no"]}),
    (CompletionRequest, "suffix", "the end"),
    (CompletionRequest, "prompt_logprobs", 1),
    (CompletionRequest, "use_beam_search", True),
]


def _body(model, **fields) -> bytes:
    return json.dumps({**(CHAT_BODY if model is ChatCompletionRequest else COMPLETION_BODY), **fields}).encode()


@pytest.mark.parametrize("model, field, value", UNSERVED, ids=[f"{f}={v}"[:40] for _, f, v in UNSERVED])
def test_a_field_we_cannot_honour_is_a_400_naming_it_not_ignored(model, field, value):
    with pytest.raises(APIError) as exc:
        parse_request(model, _body(model, **{field: value}))
    error = exc.value.body()["error"]
    assert exc.value.status == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == field and error["message"].startswith(f"{field} ") and error["code"]


def test_values_that_change_nothing_are_served():
    parse_request(ChatCompletionRequest, _body(ChatCompletionRequest, response_format={"type": "text"}, tools=[],
                                               tool_choice="none", functions=None, user="u", guided_json=None))
    parse_request(CompletionRequest, _body(CompletionRequest, suffix="", user="u", use_beam_search=False))
