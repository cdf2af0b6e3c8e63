"""Ray Serve: two replicas of the tiny checkpoint on a local Ray (CPU), each its own engine, the OpenAI routes
through Serve's HTTP proxy on loopback."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend import LLM, SamplingParams
from tests.server_fixture import free_port

ray = pytest.importorskip("ray", reason="Ray Serve: pip install 'ray[serve]' (the [ray] extra)")
serve = pytest.importorskip("ray.serve")

MODEL = "tiny"
PROMPTS = ["Hello world! The quick", "Paged attention stores", "def main(): return", "Numbers 0123"] * 2
# Output lengths 1, 2, 4, ..., 128: the tokens any subset of requests generates tell which requests they were.
MAX_TOKENS = [2**i for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def app_url(tiny_ckpt):
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        from frontend.ray_serve import build

        args = {"model": str(tiny_ckpt), "device": "cpu", "max_model_len": "256", "num_kv_blocks": "128"}
        serve.run(build({**args, "served_model_name": MODEL, "num_replicas": "2"}), name="pico", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _generated_tokens(url: str) -> float:
    """vllm:generation_tokens_total of the replica that answers this scrape."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "vllm:generation_tokens_total":
                return sample.value
    raise AssertionError("no vllm:generation_tokens_total")


def test_two_replicas_each_run_an_engine_and_answer_like_llm(app_url, tiny_ckpt):
    replicas = serve.status().applications["pico"].deployments["EngineReplica"].replica_states
    assert replicas == {"RUNNING": 2}
    assert httpx.get(f"{app_url}/health").status_code == 200
    assert [m["id"] for m in httpx.get(f"{app_url}/v1/models").json()["data"]] == [MODEL]

    def complete(i: int) -> str:
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": 0, "ignore_eos": True}
        resp = httpx.post(f"{app_url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(complete, range(len(PROMPTS))))
    with LLM(str(tiny_ckpt), device="cpu", max_model_len=256, num_kv_blocks=128) as llm:
        refs = llm.generate(PROMPTS, [_greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    assert texts == [ref.outputs[0].text for ref in refs]

    seen = set()  # each replica's own count: two values, both above 0, adding up to every token generated
    for _ in range(60):
        seen.add(_generated_tokens(app_url))
        if len(seen) == 2:
            break
    assert len(seen) == 2 and min(seen) > 0 and sum(seen) == sum(MAX_TOKENS), seen
