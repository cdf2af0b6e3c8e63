"""The OpenAI API's request handling and output rules, without a server: what vLLM's users rely on."""

from __future__ import annotations

import json

import pytest

from frontend.api_errors import APIError, parse_request
from frontend.openai_requests import ChatCompletionRequest, CompletionRequest
from frontend.output_processor import CompletionOutput, OutputProcessor
from protocol.messages import TokenBatch, i32
from protocol.sampling import SamplingParams


class ByteTokenizer:
    """A byte-level vocabulary small enough to read: a token is its bytes; a split character decodes as U+FFFD.
    Like Hugging Face's slow tokenizers, it puts spaces around special tokens unless told not to."""

    PIECES = {0: b"<s>", 1: b"ab", 2: b"c\xf0\x9f", 3: b"\xa6\x80", 4: b"<|end|>", 5: b" x"}
    SPECIAL = {0, 4}

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True, **kw
    ) -> str:
        pieces = [self.PIECES[i] for i in ids if not (skip_special_tokens and i in self.SPECIAL)]
        if spaces_between_special_tokens and not skip_special_tokens:
            pieces = [b" " + p + b" " if p in (self.PIECES[0], self.PIECES[4]) else p for p in pieces]
        return b"".join(pieces).decode("utf-8", errors="replace")


def generate(
    params: SamplingParams, steps: list[tuple[int, str | None]], texts: list[str] | None = None
) -> CompletionOutput:
    """Feed one sample's engine tokens (and finish reasons) through the OutputProcessor; its output. `texts`
    gets the text after each step (what a stream has sent by then)."""
    processor = OutputProcessor(ByteTokenizer())
    state, (msg,) = processor.register("r", None, [0], params)
    for token, reason in steps:
        processor.process(TokenBatch(0, [msg.request_id], i32([token]), {msg.request_id: reason} if reason else {}))
        if texts is not None:
            texts.append(state.output.outputs[0].text)
    return state.output.outputs[0]


def test_chat_content_parts_are_joined_with_newlines_like_vllm():
    req = parse_request(
        ChatCompletionRequest,
        b'{"messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]}',
    )
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
    (ChatCompletionRequest, "functions", [{"name": "f", "parameters": {}}]),
    (ChatCompletionRequest, "function_call", "auto"),
    (CompletionRequest, "suffix", "the end"),
    (CompletionRequest, "use_beam_search", True),
]  # response_format, tools and guided decoding are served: tests/test_structured_outputs.py


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
    parse_request(
        ChatCompletionRequest,
        _body(
            ChatCompletionRequest,
            response_format={"type": "text"},
            tools=[],
            tool_choice="none",
            functions=None,
            user="u",
            guided_json=None,
        ),
    )
    parse_request(CompletionRequest, _body(CompletionRequest, suffix="", user="u", use_beam_search=False))


# ---- vLLM's output extensions of SamplingParams: skip_special_tokens, spaces_between_special_tokens,
# include_stop_str_in_output ----------------------------------------------------------------------------


def test_special_tokens_text_is_skipped_by_default_and_kept_when_asked():
    steps = [(1, None), (4, None), (5, "length")]
    assert generate(SamplingParams(max_tokens=3), steps).text == "ab x"
    assert generate(SamplingParams(max_tokens=3, skip_special_tokens=False), steps).text == "ab <|end|>  x"
    assert (
        generate(
            SamplingParams(max_tokens=3, skip_special_tokens=False, spaces_between_special_tokens=False), steps
        ).text
        == "ab<|end|> x"
    )


def test_stop_string_is_cut_off_by_default_and_kept_with_include_stop_str_in_output():
    steps = [(1, None), (5, None), (5, "length")]  # "ab", " x", " x"
    cut_texts, kept_texts = [], []
    cut = generate(SamplingParams(max_tokens=3, stop=["b x"]), steps, cut_texts)
    kept = generate(SamplingParams(max_tokens=3, stop=["b x"], include_stop_str_in_output=True), steps, kept_texts)
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("a", "stop", "b x")
    assert (kept.text, kept.finish_reason, kept.stop_reason) == ("ab x", "stop", "b x")
    assert cut_texts[0] == "a" and kept_texts[0] == "ab"  # as vLLM: nothing held back when the stop is kept


def test_stop_token_text_is_left_out_unless_include_stop_str_in_output_like_vllm():
    stop_id = generate(SamplingParams(stop_token_ids=[5]), [(1, None), (5, "stop")])
    assert (stop_id.text, stop_id.token_ids, stop_id.stop_reason) == ("ab", [1, 5], 5)
    kept = generate(SamplingParams(stop_token_ids=[5], include_stop_str_in_output=True), [(1, None), (5, "stop")])
    assert kept.text == "ab x"
    specials = dict(skip_special_tokens=False, spaces_between_special_tokens=False)
    eos = generate(SamplingParams(**specials), [(1, None), (4, "stop")])
    assert eos.text == "ab"  # the EOS that ended it is no part of the answer, even with special tokens kept
    eos_kept = generate(SamplingParams(**specials, include_stop_str_in_output=True), [(1, None), (4, "stop")])
    assert eos_kept.text == "ab<|end|>"


def test_output_flags_are_validated_sent_on_the_wire_and_taken_from_api_requests():
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")
    params = SamplingParams(
        skip_special_tokens=False, spaces_between_special_tokens=False, include_stop_str_in_output=True
    )
    assert SamplingParams.from_dict(params.to_dict()) == params
    for model in (CompletionRequest, ChatCompletionRequest):
        req = parse_request(
            model,
            _body(
                model, skip_special_tokens=False, spaces_between_special_tokens=False, include_stop_str_in_output=True
            ),
        )
        got = req.sampling_params({})
        assert (got.skip_special_tokens, got.spaces_between_special_tokens, got.include_stop_str_in_output) == (
            False,
            False,
            True,
        )
        silent = parse_request(model, _body(model)).sampling_params({})
        assert (
            silent.skip_special_tokens,
            silent.spaces_between_special_tokens,
            silent.include_stop_str_in_output,
        ) == (True, True, False)
