"""Bad input: every kind gets its documented error while a stream runs beside it, undisturbed.

The case table is test_server.py's (one case each, checked with a good request after it there); this
module adds kinds it lacks, the API-key cases, and checks that issue 9's list is covered in full.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.reliability.harness import AUTH, completion, running_server, wait_idle
from tests.server_fixture import assert_error, post
from tests.test_server import BAD_INPUTS, CHAT, KEY, MAX_MODEL_LEN, MODEL, OK_C, OK_CHAT, C

MORE_BAD_INPUTS = [  # (name, path, body, status, param): kinds the server test does not send
    ("repetition_penalty negative", C, {**OK_C, "repetition_penalty": -1}, 400, "repetition_penalty"),
    ("presence_penalty under -2", CHAT, {**OK_CHAT, "presence_penalty": -2.5}, 400, "presence_penalty"),
    ("frequency_penalty over 2", C, {**OK_C, "frequency_penalty": 2.01}, 400, "frequency_penalty"),
    ("top_p negative", C, {**OK_C, "top_p": -0.1}, 400, "top_p"),
    ("temperature NaN", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("temperature huge", C, {**OK_C, "temperature": 1e308}, 400, "temperature"),
    ("n zero", C, {**OK_C, "n": 0}, 400, "n"),
    ("chat n too large", CHAT, {**OK_CHAT, "n": 17}, 400, "n"),
    ("logprobs negative", C, {**OK_C, "logprobs": -1}, 400, "logprobs"),
    ("min_tokens negative", C, {**OK_C, "min_tokens": -1}, 400, "min_tokens"),
    ("stop_token_ids negative", C, {**OK_C, "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ("chat max_tokens zero", CHAT, {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    (
        "chat prompt over max_model_len",
        CHAT,
        {**OK_CHAT, "messages": [{"role": "user", "content": "Hello world! " * MAX_MODEL_LEN}]},
        400,
        "messages",
    ),
    ("token id outside the vocabulary in a batch", C, {**OK_C, "prompt": [[1, 2], [3, 10**9]]}, 400, "prompt"),
    ("message without a role", CHAT, {**OK_CHAT, "messages": [{"content": "x"}]}, 400, "messages"),
    ("max_tokens fractional", C, {**OK_C, "max_tokens": 2.5}, 400, "max_tokens"),
    ("stop list holding a number", C, {**OK_C, "stop": ["a", 3]}, 400, "stop"),
    ("stream_options a string", C, {**OK_C, "stream": True, "stream_options": "yes"}, 400, "stream_options"),
    ("missing prompt", C, {"model": MODEL, "max_tokens": 2}, 400, "prompt"),
    ("empty body", C, b"", 400, None),
    ("JSON string body", C, b'"hello"', 400, None),
    ("JSON nested 100000 deep", C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("integer of 5000 digits", C, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),
]
KEY_CASES = [  # (name, path, body, status, param, key)
    ("missing API key", C, OK_C, 401, None, None),
    ("wrong API key", CHAT, OK_CHAT, 401, None, "wrong-key"),
    ("API key with one more character", C, OK_C, 401, None, KEY + "x"),
]
CASES = [(*case, KEY) for case in BAD_INPUTS + MORE_BAD_INPUTS] + KEY_CASES

ISSUE_KINDS = {  # issue 9's list -> the cases that cover each kind
    "zero, negative or huge max_tokens": ["max_tokens zero", "max_tokens negative", "max_tokens huge"],
    "temperature < 0": ["temperature negative"],
    "top_p 0 or > 1": ["top_p zero", "top_p over one"],
    "top_k < -1": ["top_k below -1"],
    "min_p outside [0, 1]": ["min_p negative", "min_p over one"],
    "penalties outside [-2, 2]": [
        "presence_penalty over 2",
        "presence_penalty under -2",
        "frequency_penalty over 2",
        "frequency_penalty under -2",
    ],
    "repetition_penalty <= 0": ["repetition_penalty zero", "repetition_penalty negative"],
    "n too large": ["n too large", "chat n too large"],
    "logprobs > 20": ["logprobs over 20", "top_logprobs over 20"],
    "empty prompt": ["empty prompt", "empty prompt list"],
    "empty messages": ["empty messages"],
    "an unknown role": ["unknown role"],
    "token ids outside the vocabulary": ["token id over the vocabulary", "negative token id"],
    "a prompt over max_model_len": ["prompt over max_model_len", "chat prompt over max_model_len"],
    "prompt + max_tokens over max_model_len": ["prompt + max_tokens over max_model_len"],
    "invalid UTF-8": ["invalid UTF-8"],
    "wrong JSON types": ["max_tokens a string", "temperature a list", "prompt a number", "messages a string"],
    "a 10 MB body": ["10 MB body"],
    "an unknown model": ["unknown model"],
    "a missing or wrong API key": ["missing API key", "wrong API key"],
    "stream_options without stream": ["stream_options without stream"],
    "an empty stop string": ["empty stop string"],
    "too many stop strings": ["too many stop strings"],
}


def test_issue_9s_list_of_bad_inputs_is_covered_by_at_least_30_kinds():
    names = [case[0] for case in CASES]
    assert len(names) == len(set(names)) and len(names) >= 30
    missing = {kind: [n for n in cases if n not in names] for kind, cases in ISSUE_KINDS.items()}
    assert not any(missing.values()), missing


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    with running_server(tiny_ckpt, tmp_path_factory.mktemp("bad")) as server:
        yield server


def test_every_bad_input_gets_its_error_while_a_stream_beside_it_is_undisturbed(server):
    alone = completion(server, "Hello", 240).json()["choices"][0]["text"]
    chunks: list[str] = []

    def stream() -> None:
        body = {
            "model": MODEL,
            "prompt": "Hello",
            "max_tokens": 240,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120) as resp:
            chunks.extend(resp.iter_lines())

    beside = threading.Thread(target=stream)
    beside.start()
    failures = []
    for name, path, body, status, param, key in CASES:
        try:
            assert_error(post(server.url, path, body, key), status, param)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    beside.join(120)
    assert not failures, failures
    lines = [line for line in chunks if line]
    events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == alone and lines[-1] == "data: [DONE]"
    wait_idle(server, 10)  # no refused request holds a block


@pytest.mark.parametrize("method, path", [("GET", "/v1/completions"), ("POST", "/health")])
def test_a_wrong_method_is_405_in_the_error_body(server, method, path):
    assert_error(httpx.request(method, server.url + path, headers=AUTH), 405, None)
