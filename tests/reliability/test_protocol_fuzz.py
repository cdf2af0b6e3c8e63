"""Protocol: random, mutated and oversized frames sent to a running engine's sockets are refused and
logged, no process dies, no KV block leaks, and the engine then answers exactly as before.

The sockets: the scheduler's ROUTER (frontends) and its PULL (worker results) are fuzzed. The worker's
plan socket is not: it takes plans only from its own scheduler and treats a malformed one as fatal by
design (a WorkerError ends the engine, which is restarted). Nothing else can feed it: it connects to the
scheduler's PUSH inside the 0700 ipc directory, and a foreign PUSH cannot talk to a PUSH (tested below).

A well-formed WorkerError on the PULL is left out, as it is not malformed (a worker's report of its death).
A Shutdown on the ROUTER is sent: from this foreign client it is refused, and the engine goes on.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from protocol.codec import MAX_FRAME_BYTES, ProtocolError, decode, encode
from protocol.messages import MESSAGE_TYPES, Abort, AddRequest, GetStats, Ready, Shutdown, WorkerError
from tests.reliability.harness import completion, gone, running_server, tmp_of, wait_idle, wait_until
from tests.test_protocol import SAMPLES, _mutate, _mutation, _values

FRONTEND_MESSAGES = (AddRequest, Abort, GetStats)  # what the ROUTER serves without a warning


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    with running_server(tiny_ckpt, tmp_path_factory.mktemp("fuzz")) as server:
        yield server


@pytest.fixture(scope="module")
def reference(server) -> str:
    return _text(server)


def _text(server) -> str:
    resp = completion(server, "Hello world", 16)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _ipc(server, name: str) -> str:
    (ipc_dir,) = tmp_of(server).glob("pico-vllm-*")
    return f"ipc://{ipc_dir / name}"


def _mutated(msg, mutations) -> bytes:
    frame = encode(msg)
    for op, at, data in mutations:
        frame = _mutate(frame, op, at, data)
    return frame


def _tagged(name: str, fields: dict) -> bytes:
    """A map with a real type tag and version, so that the field checks are reached."""
    return msgpack.packb({**fields, "type": name, "v": 1}, use_bin_type=True)


FRAMES = st.one_of(
    st.binary(max_size=200),
    st.builds(_mutated, st.sampled_from(SAMPLES), st.lists(_mutation, min_size=1, max_size=4)),
    st.builds(lambda value: msgpack.packb(value, use_bin_type=True), _values),
    st.builds(
        _tagged, st.sampled_from(sorted(MESSAGE_TYPES)), st.dictionaries(st.text(max_size=16), _values, max_size=6)
    ),
)


def _decoded(frame: bytes):
    try:
        return decode(frame)
    except ProtocolError:
        return None


def _warnings(log: Path, source: str) -> int:
    return sum(f"from {source}" in line and "WARNING" in line for line in log.read_text().splitlines())


def _fuzz(sock: zmq.Socket, forbidden: tuple[type, ...], quiet: tuple[type, ...]) -> int:
    """Send hypothesis frames on `sock`; return how many should each log one warning."""
    expected = [0]

    @settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(FRAMES)
    def send(frame: bytes) -> None:
        msg = _decoded(frame)
        assume(not isinstance(msg, forbidden))
        sock.send(frame)
        expected[0] += not isinstance(msg, quiet)

    send()
    return expected[0]


def _assert_unharmed(server, reference: str) -> None:
    assert server.proc.poll() is None and not any(gone(pid) for pid in server.child_pids().values())
    wait_idle(server, 30)  # requests a fuzzed frame happened to add are done; every block is free again
    assert _text(server) == reference


@pytest.mark.parametrize(
    "name, kind, forbidden, quiet, source",
    [
        ("engine", zmq.DEALER, (), (*FRONTEND_MESSAGES, Shutdown), "a frontend"),
        ("results", zmq.PUSH, (WorkerError,), (), "a worker"),
    ],
    ids=["engine", "results"],
)
def test_fuzzed_frames_are_logged_and_dropped_and_the_engine_is_unharmed(
    server, reference, name, kind, forbidden, quiet, source
):
    before = _warnings(server.log, source)
    with zmq.Context() as ctx, ctx.socket(kind) as sock:
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(_ipc(server, name))
        expected = _fuzz(sock, forbidden, quiet)
    assert expected > 100
    wait_until(lambda: _warnings(server.log, source) - before >= expected, 20, f"{expected} warnings logged")
    assert _warnings(server.log, source) - before == expected
    _assert_unharmed(server, reference)


def test_a_frame_over_the_size_cap_is_refused_before_it_is_read(server, reference):
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as small, ctx.socket(zmq.DEALER) as big:
        for sock in (small, big):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(_ipc(server, "engine"))
        big.send(b"\xc1" * (MAX_FRAME_BYTES + 1))
        small.send(b"\xc1" * 1000)  # under the cap: read, logged as malformed, and its sender greeted
        assert small.poll(10_000) and isinstance(decode(small.recv()), Ready)
        assert not big.poll(1000)  # never read: no hello back
    assert "-byte cap" not in server.log.read_text()  # refused by the socket, not after buffering it
    _assert_unharmed(server, reference)


def test_a_foreign_socket_cannot_feed_the_workers_plan_socket(server, reference):
    with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(_ipc(server, "plan0"))
        with contextlib.suppress(zmq.Again):  # the pipe goes once the handshake fails, which may be mid-loop
            for _ in range(20):
                sock.send(b"\xc1 not a plan", zmq.NOBLOCK)  # queued: the handshake that would carry it fails
    _assert_unharmed(server, reference)  # the worker dies of a malformed plan: it got none
