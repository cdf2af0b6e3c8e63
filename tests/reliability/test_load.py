"""Load: 256 concurrent streams all complete with the right tokens; a consumer slower than the engine
still gets every token and the finish; a full waiting queue answers 503."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from frontend import AsyncLLM, SamplingParams
from tests.reliability.harness import AUTH, completion, running_server, wait_idle
from tests.test_server import MODEL, PROMPTS

CONCURRENT = 256
MAX_TOKENS = 8


async def _request(client: httpx.AsyncClient, body: dict) -> tuple[int, list[dict]]:
    """(status, the JSON of every event) of a stream, or (status, [the JSON body]) of anything else."""
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200 or not body.get("stream"):
            return resp.status_code, [json.loads(await resp.aread())]
        return 200, [
            json.loads(line[len("data: ") :]) async for line in resp.aiter_lines() if line.startswith("data: {")
        ]


def _run_all(url: str, bodies: list[dict]) -> list[tuple[int, list[dict]]]:
    async def main():
        limits = httpx.Limits(max_connections=len(bodies) + 8)
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_request(client, body) for body in bodies))

    return asyncio.run(main())


def _body(prompt: str, max_tokens: int, stream: bool, **fields) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **fields,
    }


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    with running_server(tiny_ckpt, tmp_path_factory.mktemp("load")) as server:
        yield server


def test_256_concurrent_streams_complete_with_the_right_tokens(server):
    alone = {p: completion(server, p, MAX_TOKENS).json()["choices"][0]["text"] for p in PROMPTS}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(CONCURRENT)]
    results = _run_all(server.url, [_body(p, MAX_TOKENS, True, logprobs=1) for p in prompts])
    for prompt, (status, events) in zip(prompts, results):
        assert status == 200
        chunks = [e for e in events if e["choices"]]
        assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == MAX_TOKENS  # one per token
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert "".join(c["choices"][0]["text"] for c in chunks) == alone[prompt]  # as when served alone
    wait_idle(server, 10)


def test_a_consumer_slower_than_the_engine_still_gets_every_token_and_the_finish(tiny_ckpt):
    """Under load a stream's consumer (the HTTP writer) lags the engine: all the remaining tokens and the
    finish can land while it is away, and must still reach it."""
    engine = AsyncLLM(str(tiny_ckpt), device="cpu", num_kv_blocks=64)

    async def slowly() -> list:
        outs = []
        async for out in engine.generate(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        ):
            outs.append(out)
            await asyncio.sleep(0.5)  # the engine finishes meanwhile
        return outs

    try:
        final = asyncio.run(slowly())[-1]
    finally:
        engine.shutdown()
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert len(final.outputs[0].token_ids) == MAX_TOKENS


@pytest.fixture(scope="module")
def small_queue(tiny_ckpt, tmp_path_factory):
    flags = ("--max-num-seqs", "1", "--max-waiting-requests", "2")
    with running_server(tiny_ckpt, tmp_path_factory.mktemp("queue"), *flags) as server:
        yield server


def test_past_max_waiting_requests_new_requests_get_503_not_a_longer_queue(small_queue):
    # Two waiting (three when the first is scheduled before the third arrives) fill the engine for seconds;
    # the rest arrive meanwhile.
    bodies = [_body(PROMPTS[0], 100, stream=i % 2 == 0) for i in range(12)]
    results = _run_all(small_queue.url, bodies)
    statuses = [status for status, _ in results]
    assert statuses.count(200) >= 2 and statuses.count(503) >= 1 and set(statuses) == {200, 503}, statuses
    for body, (status, events) in zip(bodies, results):
        if status == 503:  # streams too: the refusal comes before the 200 header
            assert events[0]["error"]["code"] == "engine_overloaded"
            assert "max_waiting_requests=2" in events[0]["error"]["message"]
        elif body["stream"]:
            assert events[-1]["usage"]["completion_tokens"] == 100
        else:
            assert events[0]["usage"]["completion_tokens"] == 100
    wait_idle(small_queue, 10)
    assert completion(small_queue, PROMPTS[0], 4).status_code == 200
