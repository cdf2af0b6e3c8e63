"""The OpenAI API's request handling and output rules, without a server: what vLLM's users rely on."""
from __future__ import annotations

from frontend.api_models import ChatCompletionRequest, parse_request
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
