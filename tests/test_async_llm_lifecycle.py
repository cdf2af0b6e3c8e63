"""AsyncLLM's life cycle at its edges: new event loops, shutdown, cancelled consumers, engines that never answer."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import msgpack
import pytest
import zmq

from frontend import AsyncLLM, SamplingParams
from frontend.engine_client import EngineDeadError

PROMPT = [11, 22, 33, 44, 55]
LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    llm = AsyncLLM(str(tiny_ckpt), device="cpu", num_kv_blocks=256)
    yield llm
    llm.shutdown()


async def _tokens(llm: AsyncLLM, request_id: str, max_tokens: int = 4) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = [o async for o in llm.generate(PROMPT, params, request_id)]
    return outs[-1].outputs[0].token_ids


def test_one_async_llm_serves_consecutive_event_loops(engine):
    """asyncio.run twice (a notebook, pytest-asyncio's loop per test): the second loop used to wait forever."""
    first = asyncio.run(_tokens(engine, "loop-1"))
    second = asyncio.run(asyncio.wait_for(_tokens(engine, "loop-2"), 30))
    assert second == first and len(first) == 4


def test_a_second_running_event_loop_is_a_clear_error(engine):
    started, release = threading.Event(), threading.Event()

    async def hold():
        async for _ in engine.generate(PROMPT, LONG, "held"):
            started.set()
            while not release.is_set():
                await asyncio.sleep(0.05)
            break

    other = threading.Thread(target=asyncio.run, args=(hold(),))
    other.start()
    try:
        assert started.wait(60)
        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(_tokens(engine, "intruder"))
    finally:
        release.set()
        other.join(30)


async def _wait_engine_idle(llm: AsyncLLM, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = await llm.get_stats()
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        await asyncio.sleep(0.1)


def test_cancelled_consumer_aborts_its_request_and_frees_blocks(engine):
    """A client that disconnects cancels the task iterating generate(): the engine must stop that request."""

    async def run():
        async def consume():
            async for _ in engine.generate(PROMPT, LONG, "cancel-me"):
                pass

        task = asyncio.create_task(consume())
        while (await engine.get_stats())["num_running"] == 0:
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_engine_idle(engine)
        return await _tokens(engine, "after-cancel")  # the others keep being served

    assert len(asyncio.run(run())) == 4


def test_consumer_that_raises_ends_only_its_own_request(engine):
    async def run():
        async def failing():
            async for _ in engine.generate(PROMPT, LONG, "raiser"):
                raise KeyError("consumer bug")

        results = await asyncio.gather(failing(), _tokens(engine, "bystander", 8), return_exceptions=True)
        await _wait_engine_idle(engine)
        return results

    raised, tokens = asyncio.run(run())
    assert isinstance(raised, KeyError) and len(tokens) == 8


def test_shutdown_fails_waiting_requests_and_later_calls_clearly(tiny_ckpt):
    llm = AsyncLLM(str(tiny_ckpt), device="cpu", num_kv_blocks=256)

    async def run():
        async def consume():
            async for _ in llm.generate(PROMPT, LONG, "pending"):
                if llm.client is not None:  # shut down while this request still waits for tokens
                    asyncio.get_running_loop().call_soon(llm.shutdown)

        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(consume(), 20)
        with pytest.raises(EngineDeadError, match="shut down"):
            await _tokens(llm, "too-late")

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()
    assert not llm.is_alive


def test_engine_death_between_event_loops_fails_the_next_call(tiny_ckpt):
    """The engine dies after the loop that used it has closed: the next loop's call must not wait forever."""
    llm = AsyncLLM(str(tiny_ckpt), device="cpu", num_kv_blocks=256)
    try:
        asyncio.run(_tokens(llm, "before"))
        scheduler = llm.client.procs.procs["scheduler"]
        os.kill(scheduler.pid, signal.SIGKILL)
        scheduler.wait(10)
        deadline = time.monotonic() + 10
        while llm.is_alive and time.monotonic() < deadline:  # the launcher's watcher reports the death
            time.sleep(0.05)
        with pytest.raises(EngineDeadError, match="scheduler"):
            asyncio.run(asyncio.wait_for(_tokens(llm, "after"), 20))
    finally:
        llm.shutdown()


def test_connect_to_an_address_where_nothing_listens_fails_within_its_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="no engine answered.*--headless"):
        AsyncLLM.connect(f"ipc://{tmp_path}/nobody", timeout=1.0)
    assert time.monotonic() - start < 10


def test_connect_to_an_engine_of_another_protocol_version_is_refused_at_once(tmp_path):
    """A peer answering in protocol version 2 is named as such, not waited on until the timeout."""
    address = f"ipc://{tmp_path}/v2"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)

    def answer():
        if router.poll(10_000):
            identity, _ = router.recv_multipart()
            router.send_multipart(
                [identity, msgpack.packb({"type": "Ready", "v": 2, "role": "engine", "rank": 0, "info": {}})]
            )

    peer = threading.Thread(target=answer)
    peer.start()
    try:
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="protocol version 2"):
            AsyncLLM.connect(address, timeout=60.0)
        assert time.monotonic() - start < 10
    finally:
        peer.join(15)
        router.close(linger=0)
        ctx.term()
