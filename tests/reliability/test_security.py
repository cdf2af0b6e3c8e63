"""Security: no pickle in the source, private ipc sockets, TCP only on loopback unless asked, SHA-256
prefix-cache keys, and an API key on every route but /health and /version, compared in constant time."""

from __future__ import annotations

import ast
import hashlib
import inspect
import ipaddress
import os
import re
import stat
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.routing import APIRoute

from frontend.server import ServerOptions, ServerState, build_app
from protocol.addresses import check_engine_address, make_addresses, remove_ipc_dir
from protocol.sampling import SamplingParams
from scheduler.block_manager import BlockManager
from scheduler.request import Request
from tests.reliability.harness import AUTH, running_server, tmp_of, wait_until
from tests.server_fixture import REPO, free_port

PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "shelve", "joblib"}
PICKLING_ATTRIBUTES = {"send_pyobj", "recv_pyobj"}  # pyzmq's pickle over a socket


# ---- no pickle -------------------------------------------------------------------------------------------


def pickle_uses(source: str) -> list[str]:
    """What in `source` can unpickle: imports of pickling modules, torch.load, pyzmq's *_pyobj,
    allow_pickle=True, weights_only=False."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in PICKLING_MODULES or (
                node.module == "torch" and any(a.name == "load" for a in node.names)
            ):
                found.append(node.module)
        elif isinstance(node, ast.Attribute):
            if node.attr in PICKLING_ATTRIBUTES or (
                node.attr == "load" and isinstance(node.value, ast.Name) and node.value.id == "torch"
            ):
                found.append(node.attr)
        elif isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant):
            if (node.arg, node.value.value) in (("allow_pickle", True), ("weights_only", False)):
                found.append(f"{node.arg}={node.value.value}")
    return found


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import dill as d",
        "from cloudpickle import loads",
        "torch.load(f)",
        "from torch import load",
        "sock.recv_pyobj()",
        "np.load(f, allow_pickle=True)",
        "torch.load(f, weights_only=False)",
    ],
)
def test_the_pickle_scan_finds_each_way_to_unpickle(source):
    assert pickle_uses(source)


def test_no_source_outside_tests_can_unpickle():
    files = [
        p
        for p in REPO.rglob("*.py")
        if not any(part.startswith(".") or part == "tests" for part in p.relative_to(REPO).parts)
    ]
    assert len(files) > 30
    uses = {str(p.relative_to(REPO)): u for p in files if (u := pickle_uses(p.read_text()))}
    assert uses == {}


# ---- sockets ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    with running_server(tiny_ckpt, tmp_path_factory.mktemp("security")) as server:
        yield server


def test_ipc_sockets_live_in_a_fresh_private_directory(server):
    (ipc_dir,) = tmp_of(server).iterdir()  # the server's TMPDIR was empty: the directory is its own
    info = ipc_dir.stat()
    assert ipc_dir.name.startswith("pico-vllm-") and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()
    assert sorted(p.name for p in ipc_dir.iterdir() if stat.S_ISSOCK(p.stat().st_mode)) == [
        "engine",
        "plan0",
        "results",
    ]
    first, second = make_addresses(1), make_addresses(1)
    try:
        assert first.ipc_dir != second.ipc_dir
    finally:
        remove_ipc_dir(first)
        remove_ipc_dir(second)


def _tcp_listeners(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket that one of `pids` holds."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                inodes.update(re.findall(r"^socket:\[(\d+)\]$", os.readlink(fd)))
            except OSError:  # closed meanwhile
                pass
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                words = bytes.fromhex(address)
                raw = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))  # host-order words
                found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def test_only_the_http_port_listens_and_on_127_0_0_1(server):
    pids = [server.proc.pid, *server.child_pids().values()]
    assert _tcp_listeners(pids) == {("127.0.0.1", server.port)}


def test_a_tcp_engine_address_binds_loopback_unless_a_host_is_named(tiny_ckpt, tmp_path):
    assert check_engine_address("tcp://:5555") == check_engine_address("tcp://*:5555") == "tcp://127.0.0.1:5555"
    assert check_engine_address("tcp://0.0.0.0:5555") == "tcp://0.0.0.0:5555"  # the operator asked for it
    for bad in ("tcp://127.0.0.1", "http://127.0.0.1:5555", "ipc://"):
        with pytest.raises(ValueError):
            check_engine_address(bad)
    port = free_port()
    flags = ("--headless", "--engine-address", f"tcp://*:{port}")
    with running_server(tiny_ckpt, tmp_path, *flags, ready=False) as headless:
        wait_until(lambda: "scheduler" in headless.child_pids(), 60, "the scheduler was not started")
        scheduler = headless.child_pids()["scheduler"]
        wait_until(lambda: _tcp_listeners([scheduler]), 60, "the engine does not listen", interval=0.2)
        assert _tcp_listeners([headless.proc.pid, *headless.child_pids().values()]) == {("127.0.0.1", port)}


# ---- prefix-cache keys -----------------------------------------------------------------------------------


def test_prefix_cache_keys_are_chained_sha256_of_the_token_ids():
    tokens = list(range(100, 112))  # three full blocks of four
    bm = BlockManager(num_blocks=8, block_size=4)
    req = Request("a", b"client", tokens, len(tokens), SamplingParams(), 0, 4, frozenset())
    bm.allocate(req)
    bm.cache_blocks(req, len(tokens))
    expected, key = [], b""
    for i in range(0, len(tokens), 4):
        key = hashlib.sha256(key + np.asarray(tokens[i : i + 4], dtype="<i4").tobytes()).digest()
        expected.append(key)
    assert req.block_hashes == expected
    same_prefix = Request("b", b"client", tokens + [7], len(tokens) + 1, SamplingParams(), 1, 4, frozenset())
    assert bm.allocate(same_prefix) == len(tokens)  # found under those keys


# ---- the API key -----------------------------------------------------------------------------------------


def test_the_api_key_is_compared_in_constant_time():
    source = inspect.getsource(ServerState.check_key)
    assert "hmac.compare_digest(" in source
    assert not re.search(r"(==|!=)\s*key\b|\bkey\s*(==|!=)", source)


def _routes(routes: list | None = None) -> set[tuple[str, str]]:
    """(method, path) of every route of the app; newer FastAPI nests included routers."""
    if routes is None:
        routes = build_app(ServerState(ServerOptions(api_key="k"), "m", {}), lambda: None).routes
    found = set()
    for route in routes:
        if isinstance(route, APIRoute):
            found |= {(method, route.path) for method in route.methods}
        else:
            found |= _routes(getattr(getattr(route, "original_router", route), "routes", []))
    return found


@pytest.mark.parametrize("key", [None, "wrong"])
def test_every_route_but_health_and_version_answers_401_without_the_right_key(server, key):
    routes = _routes()
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")} <= routes
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path in sorted(routes):
        resp = httpx.request(method, server.url + path, headers=headers, content=b"{}")
        expected = 200 if path in ("/health", "/version") else 401
        assert resp.status_code == expected, (method, path, resp.text[:200])
    assert httpx.post(server.url + "/tokenize", headers=AUTH, json={"prompt": "x"}).status_code == 200
