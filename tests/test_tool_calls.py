"""Qwen-format tool calls: the parser on whole answers and on every split of a stream, and the request fields."""

from __future__ import annotations

import json

import pytest

from frontend.openai_requests import ChatCompletionRequest
from frontend.output_constraints import response_format_spec
from frontend.tokenizer import load_tokenizer
from frontend.tool_calls import ToolCallStream, parse_tool_calls
from protocol.config import InvalidParam
from protocol.sampling import SamplingParams

WEATHER = {"city": "Paris", "opts": {"units": "c", "days": [1, 2], "deep": {"x": {}}}}
ANSWER = (
    'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    + json.dumps(WEATHER)
    + '}\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "noop"}},
]


def _streamed(text: str, step: int) -> tuple[str, dict]:
    """The stream's content and {call index: [id, name, joined arguments]}, `text` arriving `step` chars a time."""
    stream, content, calls = ToolCallStream(), "", {}
    for end in range(step, len(text) + step, step):
        new, deltas = stream.update(text[:end], end >= len(text))
        content += new
        for d in deltas:
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function" and d["function"]["arguments"] == ""
                calls[d["index"]] = [d["id"], d["function"]["name"], ""]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][2] += d["function"]["arguments"]
    return content, calls


def test_whole_answer_gives_content_and_calls_with_nested_and_empty_arguments():
    content, calls = parse_tool_calls(ANSWER)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [WEATHER, {}]
    assert len({c["id"] for c in calls}) == 2 and all(
        c["id"].startswith("call_") and c["type"] == "function" for c in calls
    )


@pytest.mark.parametrize("step", [1, 2, 3, 5, 11, len(ANSWER)])
def test_stream_split_anywhere_joins_to_the_whole_answers_calls(step):
    content, calls = _streamed(ANSWER, step)
    assert content.strip() == "Let me check."
    whole = parse_tool_calls(ANSWER)[1]
    assert [(name, args) for _, name, args in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole
    ]


def test_text_that_only_looks_like_a_call_stays_content():
    for text in (
        "a <tool_call>not json</tool_call> b",
        "x < tool",
        "unfinished <tool_ca",
        '<tool_call>\n{"name": "f"}\n</tool_call>',
    ):
        content, calls = parse_tool_calls(text)
        assert calls == [] and content == text.strip()
        assert _streamed(text, 2) == (text, {})


def test_no_call_is_plain_content_in_a_stream():
    assert _streamed("Hello <b>world</b>", 3) == ("Hello <b>world</b>", {})


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_required_and_named_tool_choice_become_one_grammar_and_auto_none():
    assert _request(tools=TOOLS, tool_choice="auto").constraint() == (None, None)
    assert _request(tools=TOOLS, tool_choice="none").parses_tool_calls is False
    field, spec = _request(tools=TOOLS, tool_choice="required").constraint()
    fmt = json.loads(spec["structural_tag"])["format"]
    assert field == "tool_choice" and len(fmt["tags"]) == 2 and fmt["at_least_one"] and not fmt["stop_after_first"]
    named = {"type": "function", "function": {"name": "noop"}}
    fmt = json.loads(_request(tools=TOOLS, tool_choice=named).constraint()[1]["structural_tag"])["format"]
    assert [t["begin"] for t in fmt["tags"]] == ['<tool_call>\n{"name": "noop", "arguments": '] and fmt[
        "stop_after_first"
    ]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
    ],
)
def test_bad_or_two_constraints_name_the_field(fields, param):
    with pytest.raises(Exception) as err:
        _request(**fields).sampling_params({})
    assert getattr(err.value, "param", None) == param and getattr(err.value, "status", None) == 400


def test_response_format_maps_to_structured_outputs():
    assert response_format_spec({"type": "json_object"}) == {"json_object": True}
    assert response_format_spec({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}) == {
        "json": {"type": "object"}
    }
    assert response_format_spec(None) is None and response_format_spec({"type": "text"}) is None
    with pytest.raises(InvalidParam):
        response_format_spec({"type": "json_schema"})


def test_tool_choice_none_shows_the_tools_but_parses_no_call():
    tokenizer = load_tokenizer("qwen2.5-1.5b", None)
    request = _request(tools=TOOLS, tool_choice="none")
    shown = tokenizer.decode(request.prompts(tokenizer)[0])
    assert "<tools>" in shown and '"get_weather"' in shown
    assert request.parses_tool_calls is False and request.constraint() == (None, None)
    plain = tokenizer.decode(_request().prompts(tokenizer)[0])
    assert "<tools>" not in plain


def test_min_tokens_with_a_constraint_is_refused_naming_min_tokens():
    with pytest.raises(InvalidParam) as e:
        SamplingParams(min_tokens=4, structured_outputs={"choice": ["yes", "no"]})
    assert e.value.field == "min_tokens" and "structured_outputs" in str(e.value)
    assert SamplingParams(min_tokens=0, structured_outputs={"choice": ["yes", "no"]}).min_tokens == 0
