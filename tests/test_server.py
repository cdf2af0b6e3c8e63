"""The OpenAI server end to end: `launch.py` as a real subprocess on a tiny checkpoint, the official client.

One server per module (starting an engine costs seconds); the LLM references are computed while it starts.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from frontend import LLM, SamplingParams
from frontend.api_errors import APIError, parse_request
from frontend.api_params import generation_defaults
from frontend.openai_requests import ChatCompletionRequest, CompletionRequest
from tests.server_fixture import REPO, assert_error, launch, poll_health, post

openai = pytest.importorskip("openai", reason="the official client (the GPU image lacks it): pip install openai")

KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
PROMPTS = ["Hello world! The quick", "Paged attention stores", "def main(): return", "Numbers 0123"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    refs: dict  # name -> RequestOutput of LLM.generate
    prompt_mode: subprocess.CompletedProcess
    health_seen: list[int]  # /health statuses while the server started


def _references(ckpt: Path) -> dict:
    with LLM(str(ckpt), device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64) as llm:
        tok = llm.get_tokenizer()
        chat_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
        outs = llm.generate(PROMPTS + [chat_ids, PROMPTS[0]], [GREEDY] * 5 + [LONG], use_tqdm=False)
    refs = {p: o for p, o in zip(PROMPTS, outs)}
    refs["chat"], refs["long"], refs["ckpt"] = outs[4], outs[5], str(ckpt)
    return refs


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory) -> Server:
    base = ["--model", str(tiny_ckpt), "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN)]
    log = tmp_path_factory.mktemp("server") / "server.log"
    launched = launch(base + ["--api-key", KEY, "--served-model-name", MODEL, "--num-kv-blocks", "1024"], log)
    try:
        url, proc = launched.url, launched.proc
        health_seen = poll_health(url, proc, log, lambda status: True)  # listening: the engine loads now
        prompt_mode = subprocess.Popen(
            [sys.executable, "launch.py", *base, "--prompt", PROMPTS[0], "--max-tokens", "24"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        refs = _references(tiny_ckpt)
        out, err = prompt_mode.communicate(timeout=240)
        health_seen += poll_health(url, proc, log, lambda status: status == 200)
        yield Server(
            url,
            proc,
            refs,
            subprocess.CompletedProcess(prompt_mode.args, prompt_mode.returncode, out, err),
            health_seen,
        )
    finally:
        launched.stop()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _async_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _post(server: Server, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    return post(server.url, path, body, key, **kw)


# ---- the official client: greedy text, streams, usage, stop strings -----------------------------------------


def test_health_is_503_while_the_engine_loads_then_200(server):
    assert server.health_seen[0] == 503 and server.health_seen[-1] == 200


def test_prompt_mode_prints_llm_generates_greedy_text(server):
    assert server.prompt_mode.returncode == 0, server.prompt_mode.stderr[-2000:]
    assert server.prompt_mode.stdout == server.refs[PROMPTS[0]].outputs[0].text + "\n"


def test_completion_of_a_prompt_batch_equals_llm_generate_with_usage(server):
    resp = _client(server).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    for choice, prompt in zip(resp.choices, PROMPTS):
        ref = server.refs[prompt].outputs[0]
        assert (choice.text, choice.finish_reason) == (ref.text, ref.finish_reason)
    prompt_tokens = sum(len(server.refs[p].prompt_token_ids) for p in PROMPTS)
    completion_tokens = sum(len(server.refs[p].outputs[0].token_ids) for p in PROMPTS)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
    )


def test_completion_from_token_ids_equals_text_prompt(server):
    ref = server.refs[PROMPTS[1]]
    resp = _client(server).completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=24, temperature=0)
    assert resp.choices[0].text == ref.outputs[0].text


def test_completion_stream_chunks_join_to_the_non_streamed_text(server):
    ref = server.refs[PROMPTS[2]]
    chunks = list(
        _client(server).completions.create(
            model=MODEL,
            prompt=PROMPTS[2],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_sync_and_async_streamed_and_not_equal_llm_generate(server):
    ref = server.refs["chat"]
    resp = _client(server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (
        len(ref.prompt_token_ids),
        len(ref.outputs[0].token_ids),
    )

    async def stream_both() -> tuple[list, list]:
        client = _async_client(server)
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text = await client.completions.create(
            model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, stream=True
        )
        return [c async for c in chat], [c async for c in text]

    chat_chunks, text_chunks = asyncio.run(stream_both())
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == ref.outputs[0].text
    assert chat_chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert "".join(c.choices[0].text for c in text_chunks) == server.refs[PROMPTS[3]].outputs[0].text


def test_stop_string_cuts_the_text_and_finishes_with_stop(server):
    full = server.refs["long"].outputs[0].text
    stop = full[4:7]
    expected = full[: full.find(stop)]
    kw = dict(
        model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    resp = _client(server).completions.create(**kw)
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (expected, "stop")
    chunks = [c for c in _client(server).completions.create(**kw, stream=True)]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_strings_wait_for_min_tokens_like_vllm(server):
    full = server.refs["long"].outputs[0].text
    stop = full[4:7]  # completed within the first few tokens
    resp = _client(server).completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "min_tokens": 20},
    )
    choice = resp.choices[0]
    assert resp.usage.completion_tokens > 20 and full.startswith(choice.text)
    assert len(choice.text) > full.find(stop) + len(stop)


def test_n_seeded_samples_are_reproducible_and_counted(server):
    kw = dict(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=8,
        temperature=1.0,
        n=3,
        best_of=3,
        seed=11,
        extra_body={"ignore_eos": True},
    )  # best_of == n: nothing to rank, served
    first, second = (_client(server).completions.create(**kw) for _ in range(2))
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 3 * 8 and first.usage.prompt_tokens == len(
        server.refs[PROMPTS[0]].prompt_token_ids
    )


def test_logprobs_have_one_entry_per_token_with_top_k(server):
    ref = server.refs[PROMPTS[0]].outputs[0]
    text = (
        _client(server)
        .completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, logprobs=3)
        .choices[0]
    )
    lp = text.logprobs
    assert text.text == ref.text and len(lp.tokens) == len(lp.token_logprobs) == len(ref.token_ids)
    # tokens that decode to the same text share a key, hence <= 3
    assert all(1 <= len(top) <= 3 and max(top.values()) <= 0.0 for top in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(abs(max(top.values()) - p) < 1e-4 for top, p in zip(lp.top_logprobs, lp.token_logprobs))
    chat = (
        _client(server)
        .chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2
        )
        .choices[0]
    )
    assert len(chat.logprobs.content) == len(server.refs["chat"].outputs[0].token_ids)
    assert all(len(t.top_logprobs) == 2 for t in chat.logprobs.content)


def test_echo_prepends_the_prompt(server):
    resp = _client(server).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, echo=True)
    assert resp.choices[0].text == PROMPTS[1] + server.refs[PROMPTS[1]].outputs[0].text


def test_chat_logprob_bytes_are_each_tokens_own_bytes_and_join_to_the_content(server):
    chat = (
        _client(server)
        .chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "ok"}],
            max_tokens=40,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
    )
    content = [t for t in chat.logprobs.content if not re.fullmatch(r"<\|\w+\|>", t.token)]  # specials: no text
    split = [
        ch
        for ch in chat.message.content
        if ord(ch) > 127 and ch != "\ufffd" and not any(ch in t.token for t in content)
    ]
    assert split  # this greedy output holds characters whose bytes span two tokens
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", errors="replace") == chat.message.content
    assert all(
        bytes(top.bytes).decode() == top.token for t in content for top in t.top_logprobs if "\ufffd" not in top.token
    )


def test_null_for_an_optional_flag_means_its_default(server):
    resp = _post(server, C, {**OK_C, "stream": None, "echo": None, "stream_options": None, "logprobs": None})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["logprobs"] is None
    chat = _post(server, CHAT, {**OK_CHAT, "stream": None, "logprobs": None, "top_logprobs": None})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None
    streamed = _post(server, C, {**OK_C, "stream": True, "stream_options": {"include_usage": None}})
    assert streamed.status_code == 200, streamed.text
    assert '"usage":{' not in streamed.text and streamed.text.endswith("data: [DONE]\n\n")


def test_logit_bias_with_string_token_ids_forces_the_token(server):
    body = {**OK_C, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {"70": 100}}
    text = _post(server, C, body).json()["choices"][0]["text"]
    assert text == _post(server, "/detokenize", {"tokens": [70] * 4}).json()["prompt"]


def test_special_tokens_text_is_kept_with_skip_special_tokens_false_streamed_and_not(server):
    body = {**OK_C, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {"1": 100}}  # <|im_start|>
    special = _post(server, "/detokenize", {"tokens": [1] * 4}).json()["prompt"]
    assert special == "<|im_start|>" * 4
    assert _post(server, C, body).json()["choices"][0]["text"] == ""
    kept = {**body, "skip_special_tokens": False}
    assert _post(server, C, kept).json()["choices"][0]["text"] == special
    streamed = _client(server).completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        logit_bias={"1": 100},
        stream=True,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert "".join(c.choices[0].text for c in streamed) == special


def test_include_stop_str_in_output_keeps_the_stop_string_streamed_and_not(server):
    full = server.refs["long"].outputs[0].text
    stop = full[4:7]
    expected = full[: full.find(stop) + len(stop)]
    kw = dict(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    resp = _client(server).completions.create(**kw)
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (expected, "stop")
    chunks = list(_client(server).completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"
    chat_full = server.refs["chat"].outputs[0].text
    chat_stop = chat_full[3:6]
    chat = _client(server).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stop=[chat_stop],
        stream=True,
        extra_body=kw["extra_body"],
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat) == chat_full[: chat_full.find(chat_stop) + 3]


def test_n_samples_of_the_largest_seed_are_served(server):
    kw = dict(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=4,
        temperature=1.0,
        n=2,
        seed=2**64 - 1,
        extra_body={"ignore_eos": True},
    )
    first, second = (_client(server).completions.create(**kw) for _ in range(2))
    assert [c.text for c in first.choices] == [c.text for c in second.choices] and len(first.choices) == 2


# ---- the other routes -------------------------------------------------------------------------------------


def test_models_version_health_tokenize_detokenize(server):
    assert [m.id for m in _client(server).models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()
    ids = server.refs[PROMPTS[0]].prompt_token_ids
    tokens = _post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()
    assert tokens == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    chat = _post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert chat["tokens"] == server.refs["chat"].prompt_token_ids
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": PROMPTS[0]}


def test_model_card_by_id_is_the_listed_card_and_an_unknown_id_is_404(server):
    listed = _client(server).models.list().data[0]
    assert _client(server).models.retrieve(MODEL) == listed
    with pytest.raises(openai.NotFoundError):
        _client(server).models.retrieve("Qwen/no-such-model")
    resp = httpx.get(f"{server.url}/v1/models/Qwen/no-such-model", headers={"Authorization": f"Bearer {KEY}"})
    assert_error(resp, 404, "model")
    assert resp.json()["error"]["code"] == "model_not_found"


def test_metrics_use_vllm_names_and_count_requests(server):
    _client(server).completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in text, name
    assert _metric(text, f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}') >= 1
    assert _metric(text, f'vllm:generation_tokens_total{{model_name="{MODEL}"}}') >= 5
    for name in (
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):  # queue time comes from the scheduler
        assert _metric(text, f'vllm:{name}_count{{model_name="{MODEL}"}}') >= 1, name
    assert _metric(text, f'vllm:prefix_cache_queries_total{{model_name="{MODEL}"}}') >= 1
    assert f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}}' in text


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _engine_idle(server: Server) -> bool:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    running = _metric(text, f'vllm:num_requests_running{{model_name="{MODEL}"}}')
    return running == 0 and _metric(text, f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}}') == 0.0


# ---- bad input: each answered with its code and OpenAI's error body; the server keeps serving ---------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BAD_INPUTS = [  # (name, path, body, status, param)
    ("max_tokens zero", C, {**OK_C, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", C, {**OK_C, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens huge", C, {**OK_C, "max_tokens": 10**12}, 400, "max_tokens"),
    (
        "chat max_completion_tokens huge",
        CHAT,
        {**OK_CHAT, "max_completion_tokens": 10**6},
        400,
        "max_completion_tokens",
    ),
    ("chat max_completion_tokens zero", CHAT, {**OK_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat max_tokens huge", CHAT, {**OK_CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
    ("temperature negative", C, {**OK_C, "temperature": -0.1}, 400, "temperature"),
    ("top_p zero", C, {**OK_C, "top_p": 0}, 400, "top_p"),
    ("top_p over one", CHAT, {**OK_CHAT, "top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", C, {**OK_C, "top_k": -2}, 400, "top_k"),
    ("min_p over one", C, {**OK_C, "min_p": 1.5}, 400, "min_p"),
    ("min_p negative", C, {**OK_C, "min_p": -0.5}, 400, "min_p"),
    ("presence_penalty over 2", C, {**OK_C, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency_penalty under -2", CHAT, {**OK_CHAT, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("repetition_penalty zero", C, {**OK_C, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("n too large", C, {**OK_C, "n": 17}, 400, "n"),
    ("logprobs over 20", C, {**OK_C, "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs over 20", CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("seed too large", C, {**OK_C, "seed": 2**70}, 400, "seed"),
    ("min_tokens over max_tokens", C, {**OK_C, "min_tokens": 5}, 400, "min_tokens"),
    ("empty prompt", C, {**OK_C, "prompt": ""}, 400, "prompt"),
    ("empty prompt list", C, {**OK_C, "prompt": []}, 400, "prompt"),
    ("empty token list in a batch", C, {**OK_C, "prompt": [[1, 2], []]}, 400, "prompt"),
    ("empty messages", CHAT, {**OK_CHAT, "messages": []}, 400, "messages"),
    ("unknown role", CHAT, {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (
        "image content part",
        CHAT,
        {
            **OK_CHAT,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        },
        400,
        "messages",
    ),
    ("token id over the vocabulary", C, {**OK_C, "prompt": [1, 99999]}, 400, "prompt"),
    ("negative token id", C, {**OK_C, "prompt": [-1, 3]}, 400, "prompt"),
    ("prompt over max_model_len", C, {**OK_C, "prompt": [5] * (MAX_MODEL_LEN + 10)}, 400, "prompt"),
    ("prompt + max_tokens over max_model_len", C, {**OK_C, "prompt": [5] * 200, "max_tokens": 100}, 400, "max_tokens"),
    ("invalid UTF-8", C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("malformed JSON", C, b'{"prompt": "hi", ', 400, None),
    ("JSON array body", C, b"[1, 2]", 400, None),
    ("max_tokens a string", C, {**OK_C, "max_tokens": "ten"}, 400, "max_tokens"),
    ("temperature a list", C, {**OK_C, "temperature": [1]}, 400, "temperature"),
    ("prompt a number", C, {**OK_C, "prompt": 5}, 400, "prompt"),
    ("messages a string", CHAT, {**OK_CHAT, "messages": "hi"}, 400, "messages"),
    ("stop a number", C, {**OK_C, "stop": 3}, 400, "stop"),
    ("10 MB body", C, b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413, None),
    ("unknown model", C, {**OK_C, "model": "gpt-4" * 1000}, 404, "model"),
    ("stream_options without stream", C, {**OK_C, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("empty stop string", C, {**OK_C, "stop": ["ok", ""]}, 400, "stop"),
    ("too many stop strings", CHAT, {**OK_CHAT, "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("max_tokens 0 without echo", C, {**OK_C, "max_tokens": 0}, 400, "max_tokens"),
    ("prompt_logprobs over 20", C, {**OK_C, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("prompt_logprobs streamed", CHAT, {**OK_CHAT, "stream": True, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("best_of over n (one sample is not the best of several)", C, {**OK_C, "best_of": 3}, 400, "best_of"),
    ("logit_bias over 100", C, {**OK_C, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias outside the vocabulary", CHAT, {**OK_CHAT, "logit_bias": {"1000000": 1}}, 400, "logit_bias"),
    ("logit_bias key not a token id", C, {**OK_C, "logit_bias": {"hello": 1}}, 400, "logit_bias"),
    (
        "response_format json_schema that does not compile",
        CHAT,
        {
            **OK_CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
        },
        400,
        "response_format",
    ),
    (
        "tool_choice auto on a chat template that shows no tools",
        CHAT,
        {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),
    ("suffix on completions", C, {**OK_C, "suffix": "end"}, 400, "suffix"),
    ("tokenize with neither prompt nor messages", "/tokenize", {"model": MODEL}, 400, "prompt"),
    ("detokenize outside the vocabulary", "/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
]


@pytest.mark.parametrize("name, path, body, status, param", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_its_error_and_the_server_keeps_serving(server, name, path, body, status, param):
    assert_error(_post(server, path, body), status, param)
    ok = _post(server, C, {**OK_C, "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_at_least_thirty_kinds_of_bad_input_are_covered():
    assert len(BAD_INPUTS) >= 30


@pytest.mark.parametrize("key", [None, "wrong-key", KEY + "x"])
def test_wrong_or_missing_api_key_is_401_except_on_health_and_version(server, key):
    assert_error(_post(server, C, OK_C, key=key), 401, None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    assert httpx.get(f"{server.url}/v1/models/{MODEL}", headers=headers).status_code == 401
    assert httpx.get(f"{server.url}/metrics", headers=headers).status_code == 401
    assert httpx.get(f"{server.url}/health", headers=headers).status_code == 200
    assert httpx.get(f"{server.url}/version", headers=headers).status_code == 200


def test_unknown_route_is_404_in_the_same_error_body(server):
    resp = httpx.get(f"{server.url}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert_error(resp, 404, None)


def test_wrong_method_is_405_in_the_same_error_body_with_allow(server):
    resp = httpx.get(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert_error(resp, 405, None)
    assert resp.json()["error"]["type"] == "invalid_request_error" and "POST" in resp.headers["allow"]


def test_the_readme_talks_to_the_server_as_it_says(server, capsys):
    """The README's curl commands and openai snippet, pointed at this server, answer as they should."""
    readme = (REPO / "README.md").read_text().split("## Talk to the server", 1)[1]
    bash, python = re.findall(r"```(?:bash|python)\n(.*?)```", readme, re.S)[:2]

    def here(text: str) -> str:
        return text.replace("http://127.0.0.1:8000", server.url).replace("qwen2.5-1.5b", MODEL)

    exec(here(python).replace('api_key="unused"', f"api_key={KEY!r}"), {})
    assert capsys.readouterr().out.strip()
    curls = re.findall(r"^curl .*?'$", bash.replace("\\\n", " "), re.M | re.S)
    assert len(curls) == 2
    for curl in curls if shutil.which("curl") else []:
        out = subprocess.run(
            here(curl).replace("curl ", f"curl -s -H 'Authorization: Bearer {KEY}' ", 1),
            shell=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert '"choices"' in out and ("[DONE]" in out) == ('"stream": true' in curl), out[-500:]


# ---- vLLM's request extensions: each one served as vLLM serves it, or refused ------------------------------


def _hf_tokenizer(server: Server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.refs["ckpt"])


def _chat(server: Server, **fields) -> httpx.Response:
    return _post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields},
    )


def test_add_generation_prompt_false_and_continue_final_message_render_the_prompt_like_hf(server):
    tok = _hf_tokenizer(server)
    open_turn = MESSAGES + [{"role": "assistant", "content": "The answer is"}]
    for messages, flags in [
        (MESSAGES, {"add_generation_prompt": False}),
        (open_turn, {"add_generation_prompt": False, "continue_final_message": True}),
    ]:
        ids = tok.apply_chat_template(messages, tokenize=True, **flags)["input_ids"]
        resp = _chat(server, messages=messages, **flags)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == len(ids)
        assert _post(server, "/tokenize", {"messages": messages, **flags}).json()["tokens"] == ids
    assert tok.decode(ids).endswith("The answer is")  # the last turn is left open for the model to go on
    default = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert (
        _chat(server).json()["usage"]["prompt_tokens"]
        == len(default)
        != len(tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=False)["input_ids"])
    )
    assert_error(_chat(server, messages=open_turn, continue_final_message=True), 400, "continue_final_message")


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_the_prompt(server):
    ids = _post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()["tokens"]
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "echo": True}
    cut = _post(server, "/v1/completions", {**body, "prompt": PROMPTS[0], "truncate_prompt_tokens": 3}).json()
    same = _post(server, "/v1/completions", {**body, "prompt": ids[-3:]}).json()
    assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["text"] == same["choices"][0]["text"]
    whole = _post(server, "/v1/completions", {**body, "prompt": PROMPTS[0], "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)  # -1: max_model_len, longer than this prompt
    chat = _chat(server, truncate_prompt_tokens=5).json()
    assert chat["usage"]["prompt_tokens"] == 5
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        assert_error(
            _post(server, "/v1/completions", {**body, "prompt": "Hi", "truncate_prompt_tokens": bad}),
            400,
            "truncate_prompt_tokens",
        )


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(server):
    tok = _hf_tokenizer(server)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": 2}
    plain = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    as_ids = _post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    tokens = as_ids["logprobs"]["tokens"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens) and len(tokens) == 6
    assert [tok.decode([int(t.split(":")[1])]) for t in tokens] == plain["tokens"]
    assert as_ids["logprobs"]["token_logprobs"] == plain["token_logprobs"]
    assert all(re.fullmatch(r"token_id:\d+", t) for top in as_ids["logprobs"]["top_logprobs"] for t in top)
    content = _chat(server, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True).json()["choices"][0][
        "logprobs"
    ]["content"]
    assert all(re.fullmatch(r"token_id:\d+", e["token"]) and e["bytes"] == list(e["token"].encode()) for e in content)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server, path):
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        **({"prompt": PROMPTS[2]} if path == "/v1/completions" else {"messages": MESSAGES}),
    }
    for options, continuous in [
        ({"include_usage": True, "continuous_usage_stats": True}, True),
        ({"continuous_usage_stats": True}, False),
    ]:  # as vLLM: only with include_usage
        with httpx.stream(
            "POST",
            server.url + path,
            json={**body, "stream_options": options},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        ) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        with_choices = [c for c in chunks if c["choices"]]
        if not continuous:
            assert all(c["usage"] is None for c in chunks)
            continue
        counts = [c["usage"]["completion_tokens"] for c in with_choices]
        assert counts == sorted(counts) and counts[-1] == 8 and len(counts) > 1
        assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1  # the last, usage-only chunk too
        assert chunks[-1]["usage"]["completion_tokens"] == 8 and not chunks[-1]["choices"]


# ---- disconnects -------------------------------------------------------------------------------------------


def test_fifty_clients_hanging_up_mid_stream_free_every_block(server):
    async def hang_up_after_first_chunk(client: openai.AsyncOpenAI, i: int) -> None:
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPTS[i % 4],
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            break
        await stream.close()

    async def hang_up_before_the_answer(i: int) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.1)) as client:  # 200 steps take longer
            with pytest.raises(httpx.ReadTimeout):
                await client.post(
                    server.url + C,
                    headers={"Authorization": f"Bearer {KEY}"},
                    json={**OK_C, "max_tokens": 200, "ignore_eos": True},
                )

    async def main() -> None:
        client = _async_client(server)
        await asyncio.gather(
            *(hang_up_after_first_chunk(client, i) for i in range(50)),
            *(hang_up_before_the_answer(i) for i in range(5)),
        )

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while not _engine_idle(server):
        assert time.monotonic() < deadline, "blocks still in use 10 s after every client hung up"
        time.sleep(0.2)
    resp = _client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert resp.choices[0].text == server.refs[PROMPTS[0]].outputs[0].text


# ---- request -> SamplingParams, without a server --------------------------------------------------------------


def test_generation_config_fills_only_what_the_request_leaves_out(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "eos_token_id": 2})
    )
    defaults = generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    req = parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0.5}')
    params = req.sampling_params(defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.5, 20, 1.05)
    assert req.sampling_params({}).temperature == SamplingParams().temperature
    assert generation_defaults(None) == {} and generation_defaults(str(tmp_path / "missing")) == {}


def test_unknown_fields_are_ignored_and_errors_are_truncated():
    req = parse_request(CompletionRequest, b'{"prompt": "x", "metadata": {"a": "b"}, "best_of": 3, "user": "u"}')
    assert req.prompt == "x"
    with pytest.raises(APIError) as exc:
        parse_request(
            CompletionRequest, json.dumps({"prompt": "x", "stop": ["s" * 5000, ""]}).encode()
        ).sampling_params({})
    assert exc.value.param == "stop" and len(exc.value.body()["error"]["message"]) < 500
