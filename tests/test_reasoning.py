"""Reasoning models (vLLM's --reasoning-parser qwen3): thoughts split from the answer whole and on every split of a
stream, constraints that start after </think>, and the server's reasoning_content through the openai client on a
tiny checkpoint with Qwen3's offline tokenizer and template."""

from __future__ import annotations

import json

import pytest

from frontend.reasoning import ReasoningStream, split_reasoning
from protocol.grammar import build_grammar

openai = pytest.importorskip("openai")

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ok", "n"],
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
}


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("<think>\nhmm {\n</think>\n\nHello", "\nhmm {\n", "\n\nHello"),
        ("  <think>cut short", "cut short", ""),
        ("Hello <think>x</think>", None, "Hello <think>x</think>"),
        ("", None, ""),
    ],
)
def test_thoughts_are_what_an_opening_think_block_holds(text, reasoning, content):
    assert split_reasoning(text, final=True) == (reasoning, content)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("text", ["<think>\nhmm </thin k>\n</think>\n\nHi <think>", "<thi", "Hello", "<think>a</"])
def test_streamed_reasoning_and_content_join_to_the_whole(text, step):
    stream, thought, (reasoning, content) = ReasoningStream(), "", split_reasoning(text, True)
    for end in range(step, len(text) + step, step):
        new, content_so_far = stream.update(text[:end], end >= len(text))
        thought += new
        assert content.startswith(content_so_far)
    assert (thought, content_so_far) == (reasoning or "", content)


def test_a_grammar_after_the_thoughts_leaves_them_free_then_constrains(qwen3_tokenizer):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(qwen3_tokenizer, vocab_size=151936)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(
        build_grammar({"json": json.dumps(SCHEMA), "any_whitespace": False, "after": "</think>"})
    )

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(t) for t in qwen3_tokenizer.encode(text))

    assert accepts('<think>\nfree "text" {[ \n</think>{"ok": true, "n": 3}')
    assert accepts('no block is free text too: {"ok": 1')
    assert not accepts('<think>x</think>{"ok": 1')
    assert not accepts("<think>x</think>hello")


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory, qwen3_tokenizer):
    from checkpoints import make_checkpoint
    from server_fixture import launch

    ckpt = make_checkpoint(
        tmp_path_factory.mktemp("qwen3"), family="qwen3", vocab_size=151936, tokenizer=qwen3_tokenizer
    )
    args = ["--model", str(ckpt), "--device", "cpu", "--max-model-len", "1024", "--served-model-name", "x"]
    server = launch([*args, "--reasoning-parser", "qwen3"], tmp_path_factory.mktemp("log") / "server.log")
    try:
        server.wait_healthy()
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120), qwen3_tokenizer
    finally:
        server.stop()


def _bias(tokenizer) -> dict:
    """Random weights never think: the markers alone, drawn at random, open, close and reopen blocks."""
    return {str(t): 100 for t in tokenizer.convert_tokens_to_ids(["<think>", "</think>"])}


def test_reasoning_content_streams_and_joins_to_the_whole(qwen3_server):
    client, tokenizer = qwen3_server
    body = dict(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=1.0)
    thought = 0
    for seed in range(4):
        whole = client.chat.completions.create(**body, seed=seed, logit_bias=_bias(tokenizer)).choices[0].message
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(**body, seed=seed, logit_bias=_bias(tokenizer), stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
            content += (delta.content or "") if delta else ""
        assert (reasoning, content) == (whole.reasoning_content or "", whole.content or "")
        assert whole.model_extra["reasoning"] == whole.reasoning_content
        thought += whole.reasoning_content is not None
    assert thought


def test_enable_thinking_false_has_no_reasoning_and_json_applies_at_once(qwen3_server):
    client, tokenizer = qwen3_server
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    for seed in range(2):
        answer = client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            response_format=fmt,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            logit_bias=_bias(tokenizer),
        ).choices[0]
        assert answer.message.reasoning_content is None
        if answer.finish_reason == "stop":
            value = json.loads(answer.message.content)
            assert set(value) == {"ok", "n"}


def test_constraints_and_tool_calls_start_after_the_thoughts_unless_thinking_is_off(qwen3_tokenizer):
    from frontend.openai_requests import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for body, after in [
        ({"response_format": {"type": "json_object"}}, "</think>"),
        ({"tools": tools, "tool_choice": "required"}, "</think>"),
        ({"response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": False}}, None),
    ]:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
        request.bind(qwen3_tokenizer, "qwen3")
        assert request.sampling_params({}).structured_outputs.get("after") == after
        request.bind(qwen3_tokenizer, None)
        assert "after" not in request.sampling_params({}).structured_outputs
