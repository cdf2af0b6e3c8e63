"""Structured outputs through the whole engine on a tiny random checkpoint: whatever the weights, every constrained
answer parses and validates; unconstrained rows of the same batches stay Hugging Face's greedy tokens."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
from test_engine import _hf_greedy

from frontend import LLM, SamplingParams

SEEDS = range(6)
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ok", "color", "n", "tags"],
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}},
    },
}
REGEX = r"[a-z]{1,6}@(x|y)\.com"
CHOICES = ["yes", "no", "maybe not"]
EBNF = 'root ::= "(" item ("," item)? ")"\nitem ::= [0-9] | "ab"'
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56], [300]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        assert ", " in text and ": " in text and "  " not in text and "\n" not in text  # no free whitespace
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\((\d|ab)(,(\d|ab))?\)", text), text


SPECS = {
    "json": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": EBNF},
}


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu", max_num_seqs=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_tokens(tiny_ckpt) -> list[list[int]]:
    return _hf_greedy(tiny_ckpt, PROMPTS, GREEDY.max_tokens)


def test_every_constrained_answer_validates_and_free_rows_stay_greedy(llm, hf_tokens):
    kinds = [(kind, seed) for kind in SPECS for seed in SEEDS]
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=SPECS[kind])
        for kind, seed in kinds
    ] + [GREEDY] * len(PROMPTS)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))] + PROMPTS
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (kind, seed), out in zip(kinds, outs):
        o = out.outputs[0]
        if kind == "json_object" and o.finish_reason == "length":  # an object may nest past max_tokens
            continue
        assert o.finish_reason == "stop", (kind, seed, o.text)
        _check(kind, o.text)
    assert [o.outputs[0].token_ids for o in outs[len(kinds) :]] == hf_tokens
    assert sum(o.outputs[0].finish_reason == "stop" for (k, _), o in zip(kinds, outs) if k == "json_object") >= 3


def test_greedy_constrained_answer_is_the_same_alone_and_in_a_batch(llm):
    spec = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": SCHEMA})
    alone = llm.generate([PROMPTS[0]], [spec], use_tqdm=False)[0].outputs[0].text
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [spec, GREEDY, spec], use_tqdm=False)
    assert batch[0].outputs[0].text == alone
    jsonschema.validate(json.loads(alone), SCHEMA)


def test_any_whitespace_is_an_option(llm):
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=200, structured_outputs={"json": SCHEMA, "any_whitespace": True}
        )
        for s in SEEDS
    ]
    texts = [
        o.outputs[0].text
        for o in llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)
        if o.outputs[0].finish_reason == "stop"
    ]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert texts


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"regex": "(((a"}, "structured_outputs.regex"),
        ({"json": {"type": "objectx"}}, "structured_outputs.json"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_a_grammar_that_does_not_compile_fails_alone_and_frees_nothing_it_held(llm, hf_tokens, spec, words):
    bad = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec)
    with pytest.raises(Exception, match=re.escape(words)):
        llm.generate([PROMPTS[0]], [bad], use_tqdm=False)
    outs = llm.generate(PROMPTS, [GREEDY] * len(PROMPTS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0, stats


CITY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
}
EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "The forecast", "parameters": CITY}},
    {"type": "function", "function": {"name": "noop", "parameters": EMPTY}},
]
PARAMS = {"weather": CITY, "noop": EMPTY}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def test_masks_travel_in_a_shared_file_that_goes_with_the_engine(tiny_ckpt):
    import os

    from protocol.shared_masks import masks_path

    with LLM(str(tiny_ckpt), device="cpu", max_num_seqs=2) as engine:
        path = masks_path(engine.client.procs.addresses.ipc_dir)
        spec = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs={"choice": CHOICES})
        assert engine.generate([PROMPTS[0]], [spec], use_tqdm=False)[0].outputs[0].text in CHOICES
        assert os.path.getsize(path) > 0
    assert not os.path.exists(path)


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    """A server on a tiny checkpoint whose chat template is Qwen2.5's (tools, tool calls and tool results)."""
    from checkpoints import make_checkpoint
    from server_fixture import launch

    from frontend.tokenizer import qwen25_chat_template

    ckpt = make_checkpoint(tmp_path_factory.mktemp("qwen-template"))
    (ckpt / "chat_template.jinja").write_text(qwen25_chat_template())
    server = launch(
        ["--model", str(ckpt), "--device", "cpu", "--max-model-len", "2048", "--served-model-name", "x"],
        tmp_path_factory.mktemp("log") / "server.log",
    )
    try:
        server.wait_healthy()
        yield server.url
    finally:
        server.stop()


def _chat(url: str, **body) -> dict:
    from server_fixture import post

    resp = post(url, "/v1/chat/completions", {"model": "x", "messages": USER, "max_tokens": 400, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_required_and_named_tool_choice_always_call_valid_tools(qwen_server, choice):
    for seed in SEEDS:
        answer = _chat(qwen_server, tools=TOOLS, tool_choice=choice, seed=seed, temperature=1.0)["choices"][0]
        calls, content = answer["message"]["tool_calls"], answer["message"]["content"]
        _check_calls(calls, {"weather"} if isinstance(choice, dict) else set(PARAMS))
        if isinstance(choice, dict):
            assert len(calls) == 1 and content is None and answer["finish_reason"] == "tool_calls", answer
        else:  # random weights may go on calling until max_tokens: only the cut call is left unparsed
            assert (
                answer["finish_reason"] == "tool_calls"
                and content is None
                or answer["finish_reason"] == "length"
                and content.startswith("<tool_call>")
            ), answer


def test_streamed_tool_calls_join_to_the_whole_answer(qwen_server):
    import httpx

    body = {
        "model": "x",
        "messages": USER,
        "max_tokens": 400,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 1.0,
        "stream": True,
    }
    for seed, choice in zip(SEEDS, ["required", {"type": "function", "function": {"name": "noop"}}] * 2):
        body["tool_choice"] = choice
        whole = _chat(qwen_server, **{**body, "stream": False, "seed": seed})["choices"][0]["message"]["tool_calls"]
        calls, finish = {}, None
        with httpx.stream("POST", qwen_server + "/v1/chat/completions", json={**body, "seed": seed}, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])["choices"][0]
                finish = event["finish_reason"] or finish
                for d in event["delta"].get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                    call["name"] = d["function"].get("name", call["name"])
                    call["arguments"] += d["function"]["arguments"]
        assert finish == "tool_calls" or choice == "required" and finish == "length"
        assert [calls[i] for i in sorted(calls)][: len(whole)] == [c["function"] for c in whole]


def test_tool_results_in_later_turns_go_through_the_template(qwen_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    answer = _chat(qwen_server, messages=messages, tools=TOOLS, max_tokens=4, temperature=0.0)
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    from server_fixture import post

    tokenized = post(qwen_server, "/tokenize", {"model": "x", "messages": messages}).json()
    assert tokenized["count"] > 0


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format",
        ),
        ({"guided_regex": "(((a"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(qwen_server, body, param):
    from server_fixture import assert_error, post

    assert_error(post(qwen_server, "/v1/chat/completions", {"model": "x", "messages": USER, **body}), 400, param)


def test_a_grammar_past_the_time_limit_ends_its_request_alone_holding_nothing(monkeypatch):
    import time
    from types import SimpleNamespace

    from test_scheduler import make_config

    import scheduler.structured_outputs as structured
    from protocol.messages import AddRequest, i32
    from scheduler.scheduler import Scheduler

    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.2)
    slow = SimpleNamespace(compile_grammar=lambda g: time.sleep(2))
    monkeypatch.setattr(structured.StructuredOutputs, "_get_compiler", lambda self: slow)
    sched = Scheduler(make_config(), num_blocks=16)
    sched.add_request(AddRequest("slow", i32([1, 2, 3]), {"structured_outputs": {"regex": "a+"}}), b"c")
    sched.add_request(AddRequest("free", i32([1, 2, 3]), {"max_tokens": 4}), b"c")
    plan = sched.schedule()
    assert [r.row for r in plan.new_rows] == plan.rows.tolist() and len(plan.rows) == 1 and not len(plan.masked)
    while not (replies := sched.admit_compiled()):
        time.sleep(0.05)
    [(client, batch)] = replies
    assert client == b"c" and batch.finished == {"slow": "error"} and "took over" in batch.errors["slow"]
    assert not sched.structured.compiling and [r.request_id for r in sched.running] == ["free"] and not sched.waiting
    assert sched.block_manager.num_free_blocks == 16 - len(sched.running[0].block_table)


def test_the_scheduler_compiles_grammars_from_the_tokenizer_dir_without_importing_the_frontend(tiny_ckpt, tmp_path):
    """The scheduler process's imports and its compile thread, alone in a fresh interpreter."""
    import subprocess
    import sys

    code = f"""
import sys, time
import scheduler.process
from protocol.config import EngineConfig, ModelConfig
from protocol.messages import AddRequest, i32
from scheduler.scheduler import Scheduler
model = ModelConfig(8, 16, 1, 2, 1, 4, vocab_size=512, eos_token_ids=[1])
config = EngineConfig("m", max_model_len=64, model_config=model, tokenizer_dir={str(tiny_ckpt)!r})
sched = Scheduler(config, 16, {str(tmp_path / "masks")!r})
sched.add_request(AddRequest("r", i32([1, 2]), {{"structured_outputs": {{"choice": ["yes", "no"]}}}}), b"c")
deadline = time.monotonic() + 120
while not sched.waiting and time.monotonic() < deadline:
    assert sched.admit_compiled() == []
    time.sleep(0.05)
assert not sched.structured.compiling and sched.waiting[0].matcher is not None
plan = sched.schedule()
assert list(plan.masked) == [0] and sched.take_mask().rows == 1  # the first step's mask, filled at once
print(sorted(m for m in sys.modules if m.split(".")[0] == "frontend"))
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.gpu
def test_constrained_answers_validate_on_the_gpu_beside_free_rows_in_graphs(tiny_ckpt):
    """CUDA graphs, the pinned upload of masks and mixed steps: what the CPU engine does not run."""
    kinds = [(kind, seed) for kind in SPECS if kind != "json_object" for seed in range(16)]
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=SPECS[kind])
        for kind, seed in kinds
    ] + [GREEDY] * 8
    with LLM(str(tiny_ckpt), device="cuda") as gpu:
        outs = gpu.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params, use_tqdm=False)
    for (kind, seed), out in zip(kinds, outs):
        assert out.outputs[0].finish_reason == "stop", (kind, seed, out.outputs[0].text)
        _check(kind, out.outputs[0].text)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs[len(kinds) :])
