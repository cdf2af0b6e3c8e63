"""Anthropic's Messages API (POST /v1/messages) end to end, with the official anthropic client against a real server.

Greedy answers are compared with /v1/chat/completions on the same conversation: one template, the same tokens.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.server_fixture import post, readme_snippet

anthropic = pytest.importorskip("anthropic", reason="the official client: pip install anthropic")

KEY = "test-key"
GREEDY = {"extra_body": {"temperature": 0}}  # the client no longer takes temperature; the server does
CITY = {"type": "object", "properties": {"city": {"enum": ["Rome", "Paris"]}}, "required": ["city"]}
TOOLS = [
    {"name": "weather", "description": "The weather in a city.", "input_schema": CITY},
    {"name": "noop", "input_schema": {"type": "object", "properties": {}}},
]
USER = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def client(tool_server):
    return anthropic.Anthropic(base_url=tool_server, api_key=KEY, max_retries=0, timeout=120)


def _chat(url: str, messages: list[dict], max_tokens: int = 24, **body) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **body}
    resp = post(url, "/v1/chat/completions", body, KEY, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _text(message) -> str:
    assert [block.type for block in message.content] == ["text"]
    return message.content[0].text


def test_a_greedy_answer_equals_chat_completions_with_its_usage(client, tool_server):
    message = client.messages.create(model="tiny", max_tokens=24, system="Be brief.", messages=USER, **GREEDY)
    chat = _chat(tool_server, [{"role": "system", "content": "Be brief."}, *USER])
    assert _text(message) == chat["choices"][0]["message"]["content"]
    assert message.role == "assistant" and message.model == "tiny" and message.id.startswith("msg_")
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    reasons = {"length": "max_tokens", "stop": "end_turn"}
    assert message.stop_reason == reasons[chat["choices"][0]["finish_reason"]] and message.stop_sequence is None


def test_system_as_text_blocks_is_the_system_string(client):
    blocks = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    as_blocks = client.messages.create(model="tiny", max_tokens=8, system=blocks, messages=USER, **GREEDY)
    as_string = client.messages.create(model="tiny", max_tokens=8, system="Be\nbrief.", messages=USER, **GREEDY)
    assert _text(as_blocks) == _text(as_string) and as_blocks.usage.input_tokens == as_string.usage.input_tokens


def test_tool_use_and_tool_result_turns_are_the_chat_conversation_with_tool_calls(client, tool_server):
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    message = client.messages.create(model="tiny", max_tokens=16, messages=messages, tools=TOOLS, **GREEDY)
    call = {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    chat_messages = [
        messages[0],
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    chat_tools = [
        {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"], **_described(t)}}
        for t in TOOLS
    ]
    chat = _chat(tool_server, chat_messages, 16, tools=chat_tools)
    assert _text(message) == chat["choices"][0]["message"]["content"]
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]


def _described(tool: dict) -> dict:
    return {"description": tool["description"]} if "description" in tool else {}


@pytest.mark.parametrize(
    "choice, names",
    [
        ({"type": "any", "disable_parallel_tool_use": True}, {"weather", "noop"}),
        ({"type": "tool", "name": "weather"}, {"weather"}),
    ],
)
def test_tool_choice_any_and_tool_force_a_valid_call(client, choice, names):
    user = [{"role": "user", "content": "Weather?"}]
    message = client.messages.create(
        model="tiny", max_tokens=400, messages=user, tools=TOOLS, tool_choice=choice, **GREEDY
    )
    assert message.stop_reason == "tool_use" and [block.type for block in message.content] == ["tool_use"]
    (call,) = message.content
    assert call.name in names and call.id
    jsonschema.validate(call.input, next(t["input_schema"] for t in TOOLS if t["name"] == call.name))
    with client.messages.stream(
        model="tiny", max_tokens=400, messages=user, tools=TOOLS, tool_choice=choice, **GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content] == [(call.name, call.input)]
    assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens == message.usage.output_tokens


def test_a_stop_sequence_cuts_the_answer_and_is_reported(client):
    whole = _text(client.messages.create(model="tiny", max_tokens=24, messages=USER, **GREEDY))
    stop = next(
        whole[i : i + 2]
        for i in range(len(whole) // 2, len(whole))
        if whole[i : i + 2].isascii() and whole[i : i + 2].isalnum()
    )
    cut = client.messages.create(model="tiny", max_tokens=24, messages=USER, stop_sequences=[stop], **GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert whole.startswith(_text(cut) + stop) and stop not in _text(cut)


def test_the_stream_helper_and_raw_events_give_the_whole_answer(client):
    whole = client.messages.create(model="tiny", max_tokens=24, messages=USER, **GREEDY)
    with client.messages.stream(model="tiny", max_tokens=24, messages=USER, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(final) == _text(whole)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    events = list(client.messages.create(model="tiny", max_tokens=24, messages=USER, stream=True, **GREEDY))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(event.delta.text for event in events[2:-3]) == _text(whole)
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert (
        events[-2].delta.stop_reason == whole.stop_reason
        and events[-2].usage.output_tokens == whole.usage.output_tokens
    )


def test_the_raw_stream_names_each_event_and_pings(tool_server):
    body = {"model": "tiny", "max_tokens": 4, "messages": USER, "stream": True}
    with httpx.stream("POST", tool_server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert [json.loads(line.removeprefix("data: "))["type"] for line in lines[1::2]] == names


def test_bearer_and_x_api_key_are_honoured_and_a_wrong_key_is_401(tool_server):
    body = {"model": "tiny", "max_tokens": 2, "messages": USER}
    assert post(tool_server, "/v1/messages", body, KEY).status_code == 200
    with pytest.raises(anthropic.AuthenticationError) as exc:
        anthropic.Anthropic(base_url=tool_server, api_key="wrong", max_retries=0).messages.create(**body)
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "authentication_error"


BAD = [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    (
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
        },
        "tool_use",
    ),
    (
        {"max_tokens": 4, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
        "tool_choice",
    ),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "f"}]}, "input_schema"),
    ({"max_tokens": 4, "messages": USER, "temperature": -1}, "temperature"),
    ({"max_tokens": 4, "messages": USER, "stop_sequences": "x"}, "stop_sequences"),
]


@pytest.mark.parametrize("body, named", BAD, ids=[named for _, named in BAD])
def test_bad_input_is_a_400_in_anthropics_error_body_naming_the_field(tool_server, body, named):
    resp = post(tool_server, "/v1/messages", {"model": "tiny", **body}, KEY)
    assert resp.status_code == 400, resp.text
    assert resp.json()["type"] == "error" and set(resp.json()["error"]) == {"type", "message"}
    assert resp.json()["error"]["type"] == "invalid_request_error" and named in resp.json()["error"]["message"]


def test_the_client_raises_bad_request_for_a_400(client):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="tiny", max_tokens=0, messages=USER)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=USER)


def test_the_readme_snippet_talks_to_the_server(tool_server, capsys):
    exec(readme_snippet("anthropic.Anthropic", tool_server, "tiny", KEY), {})
    assert capsys.readouterr().out.strip()
