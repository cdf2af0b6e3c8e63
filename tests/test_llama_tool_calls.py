"""Tools for every family: Llama 3's JSON tool calls (vLLM's llama3_json semantics) whole and on every split of a
stream, the format each chat template teaches, and required or named calls through the server with the openai
client on a Llama 3.2 template and on a template that shows no tools (the grammar writes the call)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from frontend.llama_tool_calls import LlamaToolCallStream, parse_llama_tool_calls
from frontend.tokenizer import chat_template
from frontend.tool_formats import HERMES, LLAMA3_JSON, tool_format
from tests.test_structured_outputs import PARAMS, TOOLS, USER  # the same two tools and question

openai = pytest.importorskip("openai")

WEATHER = {"city": "Paris", "opts": {"days": [1, {}]}}
ANSWER = '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + '}; {"name": "noop", "arguments": {}}'


def _streamed(text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    stream, content, calls = LlamaToolCallStream(), "", {}
    for end in range(step, len(text) + step, step):
        new, deltas = stream.update(text[:end], end >= len(text))
        content += new
        for d in deltas:
            call = calls.setdefault(d["index"], ["", ""])
            call[0] = d["function"].get("name", call[0])
            call[1] += d["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", " \n"])
def test_json_objects_separated_by_semicolons_are_the_calls(prefix):
    content, calls = parse_llama_tool_calls(prefix + ANSWER)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [WEATHER, {}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


@pytest.mark.parametrize(
    "text", ["Hello {x}", '{"name": "f"}', ANSWER + " and more", '{"a": 1}', "{", '{"name": "f", "parameters": {}};']
)
def test_an_answer_that_is_not_all_calls_is_content(text):
    assert parse_llama_tool_calls(text) == (text, [])


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(ANSWER)])
@pytest.mark.parametrize("text", [ANSWER, "<|python_tag|>" + ANSWER, "Hello world", '{"a": 1}'])
def test_stream_split_anywhere_joins_to_the_whole_answer(text, step):
    content, calls = parse_llama_tool_calls(text)
    assert _streamed(text, step) == (
        content or "",
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
    )


def test_each_template_teaches_its_format():
    assert tool_format(chat_template("qwen3")) == (HERMES, True)
    assert tool_format(chat_template("llama32")) == (LLAMA3_JSON, True)
    assert tool_format(chat_template("llama31")) == (LLAMA3_JSON, True)
    assert tool_format("{{ messages }}") == (LLAMA3_JSON, False)


def test_llama_templates_render_tools_calls_and_results(tiny_ckpt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Rome", "days": 2}}}
    history = USER + [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]
    for name in ("llama31", "llama32"):
        text = tokenizer.apply_chat_template(
            history, tools=TOOLS, chat_template=chat_template(name), tokenize=False, add_generation_prompt=True
        )
        assert '"name": "weather"' in text and '"parameters": {"city": "Rome", "days": 2}' in text, name
        assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in text and "sunny" in text, name


def _server(tmp_path_factory, template: str | None):
    from checkpoints import make_checkpoint
    from server_fixture import launch

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"))
    if template is not None:
        (ckpt / "chat_template.jinja").write_text(chat_template(template))
    args = ["--model", str(ckpt), "--device", "cpu", "--max-model-len", "2048", "--served-model-name", "x"]
    return launch(args, tmp_path_factory.mktemp("log") / "server.log")


@pytest.fixture(scope="module", params=["llama32", None])
def client(request, tmp_path_factory):
    server = _server(tmp_path_factory, request.param)
    try:
        server.wait_healthy()
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120), request.param
    finally:
        server.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_required_and_named_calls_are_valid_whatever_the_template(client, choice):
    client, _ = client
    finished = 0
    for seed in range(3):
        answer = client.chat.completions.create(
            model="x", messages=USER, tools=TOOLS, tool_choice=choice, seed=seed, temperature=1.0, max_tokens=120
        ).choices[0]
        if answer.finish_reason == "length":  # random weights may go on calling past max_tokens
            continue
        finished += 1
        calls = answer.message.tool_calls
        assert answer.finish_reason == "tool_calls" and answer.message.content is None and calls, answer
        if isinstance(choice, dict):
            assert [c.function.name for c in calls] == ["weather"]
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])
    assert finished


def test_streamed_calls_join_to_the_whole_answers(client):
    client, _ = client
    choice = {"type": "function", "function": {"name": "weather"}}
    body = dict(model="x", messages=USER, tools=TOOLS, tool_choice=choice, temperature=1.0, max_tokens=120)
    for seed in range(1):
        whole = client.chat.completions.create(**body, seed=seed).choices[0].message.tool_calls
        calls = {}
        for chunk in client.chat.completions.create(**body, seed=seed, stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", ""])
                call[0] = d.function.name or call[0]
                call[1] += d.function.arguments or ""
        assert list(calls.values()) == [[c.function.name, c.function.arguments] for c in whole]


def test_auto_needs_a_template_that_shows_tools_and_llamas_render_tool_results(client):
    client, template = client
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    if template is None:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="x", messages=messages, tools=TOOLS, max_tokens=4)
        assert err.value.body["param"] == "tools" and "required" in err.value.body["message"]
    else:
        answer = client.chat.completions.create(model="x", messages=messages, tools=TOOLS, max_tokens=4)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
