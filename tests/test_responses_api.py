"""OpenAI's Responses API (POST /v1/responses, stateless) end to end: the openai client's responses.create and the
openai-agents SDK's default model path against a real server.

Greedy answers are compared with /v1/chat/completions on the same conversation: one template, the same tokens.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from tests.server_fixture import assert_error, post, readme_snippet

openai = pytest.importorskip("openai", reason="the official client: pip install openai")

KEY = "test-key"
CITY = {"type": "object", "properties": {"city": {"enum": ["Rome", "Paris"]}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "name": "weather", "description": "The weather in a city.", "parameters": CITY},
    {"type": "function", "name": "noop", "parameters": {"type": "object", "properties": {}}},
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k in ("name", "description", "parameters")}}
    for t in TOOLS
]
SYSTEM_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(url: str, messages: list[dict], max_tokens: int = 24, **body) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **body}
    resp = post(url, "/v1/chat/completions", body, KEY, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_instructions_and_text_input_answer_as_chat_completions_with_usage(client, tool_server):
    response = client.responses.create(
        model="tiny", instructions="Be brief.", input="Hello world!", max_output_tokens=24, temperature=0
    )
    chat = _chat(tool_server, SYSTEM_USER)
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.id.startswith("resp_") and response.object == "response" and response.store is False
    usage = chat["usage"]
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["total_tokens"],
    )
    finished = chat["choices"][0]["finish_reason"]
    assert response.status == ("incomplete" if finished == "length" else "completed")
    assert response.instructions == "Be brief." and response.max_output_tokens == 24
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]}]
    as_items = client.responses.create(
        model="tiny", input=items + [SYSTEM_USER[1]], max_output_tokens=24, temperature=0
    )
    assert as_items.output_text == response.output_text


def test_a_function_call_and_its_output_are_the_chat_conversation_with_a_tool_result(client, tool_server):
    items = [
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    response = client.responses.create(model="tiny", input=items, tools=TOOLS, max_output_tokens=16, temperature=0)
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    messages = [
        items[0],
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat = _chat(tool_server, messages, 16, tools=CHAT_TOOLS)
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "weather"}])
def test_forced_tool_choice_makes_a_valid_function_call(client, choice):
    response = client.responses.create(
        model="tiny",
        input="Weather?",
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_output_tokens=400,
        temperature=0,
    )
    assert response.status == "completed" and [item.type for item in response.output] == ["function_call"]
    (call,) = response.output
    assert call.call_id.startswith("call_") and (choice == "required" or call.name == "weather")
    jsonschema.validate(json.loads(call.arguments), next(t["parameters"] for t in TOOLS if t["name"] == call.name))


def test_text_format_json_schema_answers_json_that_validates(client):
    schema = {"type": "object", "properties": {"mood": {"enum": ["good", "bad"]}}, "required": ["mood"]}
    fmt = {"type": "json_schema", "name": "mood", "schema": schema, "strict": True}
    response = client.responses.create(
        model="tiny", input="Hello world!", text={"format": fmt}, max_output_tokens=100, temperature=0
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.status == "completed" and response.text.format.type == "json_schema"


def test_the_stream_events_build_the_whole_response(client):
    body = {"model": "tiny", "instructions": "Be brief.", "input": "Hello world!", "max_output_tokens": 24}
    whole = client.responses.create(**body, temperature=0)
    events = list(client.responses.create(**body, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-4].text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert len({event.item_id for event in events if hasattr(event, "item_id")}) == 1


def test_streamed_function_call_arguments_join_to_the_whole_call(client):
    body = dict(model="tiny", input="Weather?", tools=TOOLS, tool_choice={"type": "function", "name": "weather"})
    whole = client.responses.create(**body, max_output_tokens=400, temperature=0)
    with client.responses.stream(**body, max_output_tokens=400, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == final.output[0].arguments == whole.output[0].arguments
    assert final.output[0].name == "weather" and final.status == "completed"


UNSERVED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}}, "text.format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"temperature": -1}, "temperature"),
]


@pytest.mark.parametrize("fields, param", UNSERVED, ids=[f"{param}-{i}" for i, (_, param) in enumerate(UNSERVED)])
def test_what_is_not_served_is_a_400_naming_the_field(tool_server, fields, param):
    assert_error(post(tool_server, "/v1/responses", {"model": "tiny", "input": "Hi", **fields}, KEY), 400, param)


def test_stored_responses_are_not_found_and_store_is_reported_false(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.retrieve("resp_1")
    assert exc.value.body["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_1")
    assert client.responses.create(model="tiny", input="Hi", store=True, max_output_tokens=2).store is False


class Mood(BaseModel):
    mood: Literal["good", "bad"]


def test_an_openai_agents_agent_runs_plain_and_with_a_forced_tool_whose_output_is_fed_back(tool_server):
    """A random tiny model never stops by itself: each agent asks for an output type, whose grammar ends the turn."""
    agents = pytest.importorskip("agents", reason="pip install openai-agents")
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(
        openai.AsyncOpenAI(base_url=f"{tool_server}/v1", api_key=KEY, max_retries=0), use_for_tracing=False
    )
    calls = []

    @agents.function_tool
    def weather(city: Literal["Rome", "Paris"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    settings = dict(temperature=0, max_tokens=200)
    plain = agents.Agent(name="plain", instructions="Be brief.", model="tiny", output_type=Mood)
    plain.model_settings = agents.ModelSettings(**settings)
    tooled = agents.Agent(name="tooled", model="tiny", tools=[weather], output_type=Mood)
    tooled.model_settings = agents.ModelSettings(**settings, tool_choice="required", parallel_tool_calls=False)

    async def both() -> tuple:  # one event loop: the client's connections belong to it
        return await agents.Runner.run(plain, "Hello world!"), await agents.Runner.run(tooled, "Weather in Rome?")

    answered, called = asyncio.run(both())
    assert isinstance(answered.final_output, Mood) and len(answered.raw_responses) == 1
    assert len(calls) == 1 and isinstance(called.final_output, Mood)  # after the call, tool_choice resets to auto
    kinds = [type(item).__name__ for item in called.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    fed_back = [item for item in called.to_input_list() if item.get("type") == "function_call_output"]
    assert [item["output"] for item in fed_back] == [f"sunny in {calls[0]}"]
    first, second = (response.usage.input_tokens for response in called.raw_responses)
    assert second > first  # the call and its output went back into the prompt


def test_the_readme_snippet_talks_to_the_server(tool_server, capsys):
    exec(readme_snippet("client.responses.create", tool_server, "tiny", KEY), {})
    assert "ResponseUsage" in capsys.readouterr().out
