"""Tensor parallel over hosts on the CPU: "two nodes" as two `launch.py` runs on loopback, TP=2 (gloo), one rank
each; node 0 serves, node 1 runs only its worker. Greedy tokens equal Hugging Face's; structured outputs, whose
masks are a file on node 0, are refused."""

from __future__ import annotations

import socket
import time

import httpx
from test_engine import _hf_greedy, _prompts

from tests.server_fixture import free_port, launch

MAX_TOKENS = 10


def _free_port_run(length: int) -> int:
    """A port P with P..P+length-1 free: the rendezvous, then the scheduler's result and plan sockets."""
    for _ in range(50):
        port = free_port()
        if port + length > 65000:
            continue
        with socket.socket() as probe:
            if all(probe.connect_ex(("127.0.0.1", p)) != 0 for p in range(port + 1, port + length)):
                return port
    raise AssertionError("no run of free ports")


def test_two_nodes_on_loopback_equal_hf_greedy(tiny_ckpt, tmp_path):
    prompts = _prompts(512)[:3]
    expected = _hf_greedy(tiny_ckpt, prompts, MAX_TOKENS)
    port = _free_port_run(4)
    base = ["--model", str(tiny_ckpt), "--device", "cpu", "--tensor-parallel-size", "2", "--max-model-len", "256"]
    base += ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node1 = launch(base + ["--node-rank", "1"], tmp_path / "node1.log")
    node0 = launch(base + ["--node-rank", "0", "--served-model-name", "tiny"], tmp_path / "node0.log")
    try:
        node0.wait_healthy(240)
        assert node1.proc.poll() is None
        got = []
        for prompt in prompts:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            body |= {"logprobs": 0, "return_tokens_as_token_ids": True}
            resp = httpx.post(f"{node0.url}/v1/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            got.append([int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]])
        assert got == expected
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "response_format": {"type": "json_object"}}
        resp = httpx.post(f"{node0.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 400 and "nnodes=1" in resp.text, resp.text  # the masks are a file on node 0
        listening = _listening_ports()
        assert {port + 1, port + 2, port + 3} <= set(listening)  # the scheduler's sockets, on master_addr only
        assert all(listening[p] == "127.0.0.1" for p in (port + 1, port + 2, port + 3)), listening
    finally:
        node0.stop()
        deadline = time.monotonic() + 30  # node 0's scheduler stops node 1's worker; node 1 then exits by itself
        while node1.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        exited_by_itself = node1.proc.poll()
        node1.stop()
    assert exited_by_itself == 0, (tmp_path / "node1.log").read_text()[-3000:]


def _listening_ports() -> dict[int, str]:
    """{port: address} of the IPv4 TCP sockets listening on this machine (the run of ports was free before)."""
    listening = {}
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            addr, port = local.split(":")
            listening[int(port, 16)] = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
    return listening
