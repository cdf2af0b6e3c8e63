"""A headless engine served to other frontends: a raw zmq + msgpack client written from PROTOCOL.md alone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import zmq

from frontend import LLM, AsyncLLM, SamplingParams
from frontend.engine_client import EngineDeadError

PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def headless(tiny_ckpt, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('sock')}/engine"
    proc = subprocess.Popen(
        [
            sys.executable,
            "launch.py",
            "--model",
            str(tiny_ckpt),
            "--device",
            "cpu",
            "--headless",
            "--engine-address",
            address,
        ]
    )
    yield address
    proc.terminate()
    assert proc.wait(timeout=20) == 0


def _raw_request(address: str, prompt: list[int], max_tokens: int, garbage_first: bool = False) -> list[int]:
    """Imports nothing from this project: msgpack maps with a 'type' tag, token ids as int32 bytes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    if garbage_first:
        sock.send(b"\xc1 not msgpack")
        sock.send(msgpack.packb({"type": "AddRequest", "v": 1, "request_id": 7}))
    sock.send(msgpack.packb({"type": "GetStats", "v": 1}))
    tokens: list[int] = []
    deadline = time.monotonic() + 120
    sent = False
    while time.monotonic() < deadline:
        if not sock.poll(1000):
            continue
        msg = msgpack.unpackb(sock.recv())
        if msg["type"] == "Ready" and not sent:
            sock.send(
                msgpack.packb(
                    {
                        "type": "AddRequest",
                        "v": 1,
                        "request_id": "raw-1",
                        "prompt_token_ids": np.asarray(prompt, dtype="<i4").tobytes(),
                        "params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
                    }
                )
            )
            sent = True
        elif msg["type"] == "TokenBatch" and "raw-1" in msg["request_ids"]:
            i = msg["request_ids"].index("raw-1")
            token = int(np.frombuffer(msg["token_ids"], dtype="<i4")[i])
            if token >= 0:
                tokens.append(token)
            if "raw-1" in msg["finished"]:
                break
    sock.close(linger=0)
    ctx.term()
    return tokens


def test_raw_protocol_client_gets_llm_generate_tokens(tiny_ckpt, headless):
    tokens = _raw_request(headless, PROMPT, 8)
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        expected = (
            llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
    assert tokens == expected


def test_malformed_frames_are_rejected_and_the_engine_keeps_serving(headless):
    assert len(_raw_request(headless, PROMPT, 4, garbage_first=True)) == 4


def test_async_llm_connects_to_a_headless_engine(headless):
    engine = AsyncLLM.connect(headless)

    async def run():
        outs = [o async for o in engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6), "c-1")]
        return outs[-1]

    try:
        final = asyncio.run(run())
        assert final.finished and len(final.outputs[0].token_ids) == 6
    finally:
        engine.shutdown()


def test_connected_frontend_fails_its_requests_when_the_remote_engine_is_killed(tiny_ckpt, tmp_path):
    address = f"ipc://{tmp_path}/engine"
    proc = subprocess.Popen(
        [
            sys.executable,
            "launch.py",
            "--model",
            str(tiny_ckpt),
            "--device",
            "cpu",
            "--headless",
            "--engine-address",
            address,
        ],
        start_new_session=True,
    )
    try:
        engine = AsyncLLM.connect(address)

        async def run():
            params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
            async for out in engine.generate(PROMPT, params, "long"):
                if len(out.outputs[0].token_ids) >= 2:
                    os.killpg(proc.pid, signal.SIGKILL)  # SIGKILL: no EngineDead is ever sent

        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="stopped answering"):
            asyncio.run(run())
        assert time.monotonic() - start < 20
        engine.shutdown()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
