"""Disconnects: 200 clients that give up after 0.5 s leave no request and no KV block behind."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from tests.reliability.harness import AUTH, completion, running_server, wait_idle
from tests.test_server import MESSAGES, MODEL, PROMPTS

CLIENTS = 200
CLIENT_TIMEOUT = 0.5
ARRIVAL_GAP = 0.01  # 200 arrivals over 2 s: about 50 in flight, as a busy server sees them


def _aborted(server) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    match = re.search(
        rf'^vllm:request_success_total{{finished_reason="abort",model_name="{MODEL}"}} (\S+)$', text, re.M
    )
    return float(match.group(1)) if match else 0.0


async def _give_up(client: httpx.AsyncClient, i: int) -> bool:
    """One request of four kinds (plain or streamed, completion or chat) abandoned after 0.5 s in all."""
    stream, chat = i % 2 == 0, i % 4 >= 2
    body = {
        "model": MODEL,
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": stream,
        **({"messages": MESSAGES} if chat else {"prompt": PROMPTS[i % len(PROMPTS)]}),
    }

    async def request() -> None:
        async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as resp:
            async for _ in resp.aiter_bytes():
                pass

    await asyncio.sleep(i * ARRIVAL_GAP)
    try:
        await asyncio.wait_for(request(), CLIENT_TIMEOUT)  # a total deadline: a stream never idles 0.5 s
    except asyncio.TimeoutError:
        return True
    return False


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    with running_server(tiny_ckpt, tmp_path_factory.mktemp("hangups")) as server:
        yield server


def test_200_clients_timing_out_free_every_block_and_the_next_request_is_fast(server):
    async def main() -> list[bool]:
        limits = httpx.Limits(max_connections=CLIENTS + 8)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, limits=limits) as client:
            return await asyncio.gather(*(_give_up(client, i) for i in range(CLIENTS)))

    before = _aborted(server)
    assert all(asyncio.run(main()))
    wait_idle(server, 10)
    assert _aborted(server) - before >= CLIENTS / 2  # most reached the engine before their client left
    start = time.monotonic()
    resp = completion(server, PROMPTS[0], 16, timeout=5)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 16
    assert time.monotonic() - start < 5
