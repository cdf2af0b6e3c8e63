"""A client that speaks only pyzmq + msgpack, as PROTOCOL.md describes, against a headless engine of launch.py:
every frame gets an answer, a request id finishes once, only the owner stops the engine, a vanished client's work
is dropped, and nothing is left in the file system."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq

PROMPT = [11, 22, 33, 44, 55]


def _launch(ckpt: Path, address: str, tmp: Path, *flags: str, stderr=None) -> subprocess.Popen:
    """TMPDIR points the engine's private ipc directory into `tmp`, where the test can see it go."""
    return subprocess.Popen(
        [
            sys.executable,
            "launch.py",
            "--model",
            str(ckpt),
            "--device",
            "cpu",
            "--headless",
            "--engine-address",
            address,
            *flags,
        ],
        env={**os.environ, "TMPDIR": str(tmp)},
        stderr=stderr,
        text=True,
    )


class Client:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.send({"type": "GetStats"})
        assert self.recv()["type"] == "Ready"
        assert self.recv()["type"] == "TokenBatch"

    def send(self, msg: dict) -> None:
        self.sock.send(msgpack.packb({"v": 1, **msg}, use_bin_type=True))

    def recv(self, timeout_s: float = 60.0) -> dict:
        assert self.sock.poll(timeout_s * 1000), "the engine left a frame unanswered"
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def add(self, rid: str, prompt: list[int] = PROMPT, **params) -> None:
        self.send(
            {
                "type": "AddRequest",
                "request_id": rid,
                "prompt_token_ids": struct.pack(f"<{len(prompt)}i", *prompt),
                "params": {"temperature": 0.0, "ignore_eos": True, **params},
            }
        )

    def stats(self) -> dict:
        self.send({"type": "GetStats"})
        while (msg := self.recv())["type"] != "TokenBatch" or msg["request_ids"]:
            pass
        return msg["stats"]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def engine(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("raw")
    proc = _launch(tiny_ckpt, f"ipc://{tmp}/engine", tmp)
    yield f"ipc://{tmp}/engine"
    proc.terminate()
    assert proc.wait(timeout=20) == 0


@pytest.fixture
def client(engine):
    c = Client(engine)
    yield c
    c.close()


@pytest.mark.parametrize(
    "fields,reason",
    [
        ({"prompt_token_ids": [11, 22, 33]}, "prompt_token_ids must be raw i32 bytes"),
        ({"prompt_token_ids": None}, "AddRequest lacks field 'prompt_token_ids'"),
        ({"params": None}, "AddRequest lacks field 'params'"),
    ],
)
def test_a_malformed_request_whose_id_can_be_read_finishes_with_an_error_naming_the_reason(client, fields, reason):
    msg = {"type": "AddRequest", "request_id": "bad", "prompt_token_ids": struct.pack("<i", 5), "params": {}}
    client.send({k: v for k, v in {**msg, **fields}.items() if v is not None})
    batch = client.recv()
    assert batch["type"] == "TokenBatch" and batch["finished"] == {"bad": "error"}
    assert reason in batch["errors"]["bad"]


@pytest.mark.parametrize(
    "frame,reason",
    [
        (b"\xc1 not msgpack", "not msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"type": "AddRequest", "v": 1, "request_id": 7}), "request_id"),
        (msgpack.packb({"type": "Nope", "v": 1}), "unknown message type"),
        (msgpack.packb({"type": "GetStats", "v": 2}), "version 2"),
        (
            msgpack.packb(
                {
                    "type": "StepResult",
                    "v": 1,
                    "step": 1,
                    "token_ids": b"",
                    "logprobs": None,
                    "prompt_logprobs": None,
                    "verify_tokens": b"",
                    "timings": {},
                }
            ),
            "not a frontend message",
        ),
    ],
)
def test_a_frame_without_a_readable_request_id_gets_a_protocol_error(client, frame, reason):
    client.sock.send(frame)
    error = client.recv()
    assert error["type"] == "Error" and reason in error["reason"] and error["request_id"] is None
    client.add("after", max_tokens=2)  # and the engine goes on
    while "after" not in (msg := client.recv())["finished"]:
        pass
    assert msg["finished"]["after"] == "length"


def test_a_duplicate_live_id_is_refused_and_the_live_request_finishes_once(client):
    client.add("dup", max_tokens=40)
    client.add("dup", max_tokens=3)
    tokens, finishes, errors = [], [], []
    while not finishes:
        msg = client.recv()
        if msg["type"] == "Error":
            errors.append(msg)
        elif "dup" in msg["request_ids"]:
            (token,) = struct.unpack_from("<i", msg["token_ids"], 4 * msg["request_ids"].index("dup"))
            tokens += [token] if token >= 0 else []
            finishes += [msg["finished"]["dup"]] if "dup" in msg["finished"] else []
    assert len(errors) == 1 and errors[0]["request_id"] == "dup" and "already in use" in errors[0]["reason"]
    assert finishes == ["length"] and len(tokens) == 40


def test_n_above_one_is_refused_and_logit_bias_takes_string_keys(client):
    client.add("n2", n=2)
    batch = client.recv()
    assert batch["finished"] == {"n2": "error"} and "n=2" in batch["errors"]["n2"]
    client.add("bias", max_tokens=3, logit_bias={"7": 100})  # as a JSON-born client sends it
    tokens = []
    while "bias" not in (msg := client.recv())["finished"]:
        tokens += struct.unpack(f"<{len(msg['request_ids'])}i", msg["token_ids"])
    assert tokens[:2] == [7, 7] and msg["finished"]["bias"] == "length"


def test_a_raw_client_constrains_tokens_and_a_bad_grammar_ends_its_request_with_the_reason(client, tiny_ckpt):
    from transformers import AutoTokenizer

    client.add("choice", max_tokens=20, temperature=1.0, seed=3, structured_outputs={"choice": ["alpha", "beta"]})
    client.add("bad", structured_outputs={"regex": "(("})
    tokens, finished, errors = [], {}, {}
    while len(finished) < 2:
        msg = client.recv()
        finished.update(msg["finished"])
        errors.update(msg["errors"])
        ids = struct.unpack(f"<{len(msg['request_ids'])}i", msg["token_ids"])
        tokens += [t for rid, t in zip(msg["request_ids"], ids) if rid == "choice" and t >= 0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    assert finished == {"choice": "stop", "bad": "error"} and "structured_outputs.regex" in errors["bad"]
    assert tokenizer.decode(tokens, skip_special_tokens=True) in ("alpha", "beta")


def test_a_foreign_shutdown_is_refused_and_the_engine_keeps_serving(client):
    client.send({"type": "Shutdown"})
    error = client.recv()
    assert error["type"] == "Error" and "Shutdown refused" in error["reason"]
    assert client.stats()["num_running"] == 0


def test_a_vanished_clients_requests_are_aborted(engine, client):
    gone = Client(engine)
    for i in range(3):
        gone.add(f"long-{i}", max_tokens=3000)
    gone.recv()  # its first tokens: the requests run
    gone.close()
    deadline = time.monotonic() + 20
    while (stats := client.stats())["num_running"] + stats["num_waiting"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_sigterm_stops_a_headless_engine_and_removes_its_socket_file_and_ipc_directory(tiny_ckpt, tmp_path):
    proc = _launch(tiny_ckpt, f"ipc://{tmp_path}/engine", tmp_path, stderr=subprocess.PIPE)
    try:
        client = Client(f"ipc://{tmp_path}/engine")
        assert len(os.listdir(tmp_path)) == 2  # the engine socket and the private directory of the others
        proc.send_signal(signal.SIGTERM)
        assert client.recv()["type"] == "EngineDead"
        client.close()
        assert proc.wait(timeout=20) == 0
        assert os.listdir(tmp_path) == []
        assert "Traceback" not in (err := proc.stderr.read()) and "nanobind" not in err, err
    finally:
        proc.kill()
        proc.wait()


def test_remote_shutdown_works_only_behind_its_flag(tiny_ckpt, tmp_path):
    proc = _launch(tiny_ckpt, f"ipc://{tmp_path}/engine", tmp_path, "--allow-remote-shutdown", stderr=subprocess.PIPE)
    try:
        client = Client(f"ipc://{tmp_path}/engine")
        client.send({"type": "Shutdown"})
        assert client.recv()["type"] == "EngineDead"
        client.close()
        assert proc.wait(timeout=20) == 0  # a stop that was asked for: no error, exit 0
        assert os.listdir(tmp_path) == []
        assert "ERROR" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
