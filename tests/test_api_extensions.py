"""The OpenAI API's request handling and output rules, without a server: what vLLM's users rely on."""
from __future__ import annotations

from frontend.api_models import ChatCompletionRequest, parse_request


def test_chat_content_parts_are_joined_with_newlines_like_vllm():
    req = parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": '
                                               b'[{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]}')
    assert req.messages[0].text() == "one\ntwo"
