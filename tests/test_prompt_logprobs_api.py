"""Prompt logprobs over HTTP, with the clients that ask for them: lm-evaluation-harness's local-completions model
(echo + logprobs + max_tokens 1), the openai SDK (echo with max_tokens 0, streamed echo) and vLLM's
prompt_logprobs field, each against Hugging Face's log-softmax of the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server_fixture import launch

openai = pytest.importorskip("openai", reason="the official client: pip install openai")

MODEL = "tiny"
PROMPT = [17, 300, 41, 9, 250, 88, 120, 7]


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--model", str(tiny_ckpt), "--device", "cpu", "--max-model-len", "256", "--served-model-name", MODEL]
    launched = launch(args + ["--max-num-batched-tokens", "16"], log)  # prompts span several chunks
    try:
        launched.wait_healthy()
        yield launched
    finally:
        launched.stop()


@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, torch_dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids) - 1, vocab]: row i predicts ids[i + 1]."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)

    return logprobs


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_echo_with_max_tokens_0_scores_the_prompt_only(server, hf):
    # Token ids as keys: two top tokens of a tiny vocabulary may decode to the same text
    extra = {"return_tokens_as_token_ids": True}
    resp = _client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, extra_body=extra
    )
    (choice,) = resp.choices
    expected = hf(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, token in enumerate(PROMPT[1:]):
        assert lp.token_logprobs[i + 1] == pytest.approx(expected[i, token].item(), abs=1e-4)
        top = expected[i].topk(2)
        want = {f"token_id:{t}": v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        assert lp.top_logprobs[i + 1] == pytest.approx(want, abs=1e-4)
    assert lp.tokens == [f"token_id:{t}" for t in PROMPT] and lp.text_offset[0] == 0
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 0
    assert resp.usage.prompt_tokens == len(PROMPT)


def test_streamed_echo_sends_the_prompt_rows_first_then_the_tokens(server):
    client, body = _client(server), {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1}
    whole = client.completions.create(**body, temperature=0).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, temperature=0, stream=True) if c.choices]
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs]
    assert tokens == whole.logprobs.token_logprobs and len(tokens) == len(PROMPT) + 3
    assert "".join(c.text for c in chunks) == whole.text


def test_vllm_prompt_logprobs_in_completions_and_chat(server, hf):
    client = _client(server)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 3})
    rows = resp.model_dump()["choices"][0]["prompt_logprobs"]
    expected = hf(PROMPT)
    assert rows[0] is None and len(rows) == len(PROMPT)
    for i, (token, row) in enumerate(zip(PROMPT[1:], rows[1:])):
        top = expected[i].topk(3).indices.tolist()
        assert set(row) == {str(t) for t in [token, *top]}
        assert row[str(token)]["rank"] == int((expected[i] > expected[i, token]).sum()) + 1
        assert [row[str(t)]["rank"] for t in top if t != token] == [r + 1 for r, t in enumerate(top) if t != token]
        assert row[str(token)]["logprob"] == pytest.approx(expected[i, token].item(), abs=1e-4)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    rows = chat.model_dump()["prompt_logprobs"]
    assert rows[0] is None and all(len(row) == 1 for row in rows[1:]) and len(rows) == chat.usage.prompt_tokens


TASK = """task: pico_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
DOCS = [
    {"question": "The sky is", "choices": [" blue", " made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five", " a fish"], "answer": 0},
]


def test_lm_eval_local_completions_scores_equal_hf(server, hf, tiny_ckpt, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install 'lm_eval[api]'")
    data, tasks, results = tmp_path / "docs.jsonl", tmp_path / "tasks", tmp_path / "results"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    tasks.mkdir()
    (tasks / "pico_tiny.yaml").write_text(TASK.format(data=data))
    model_args = (
        f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={tiny_ckpt},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "none"}
    command = ["-m", "lm_eval", "--model", "local-completions", "--model_args", model_args, "--tasks", "pico_tiny"]
    command += ["--include_path", str(tasks), "--output_path", str(results), "--log_samples"]
    run = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (samples,) = results.rglob("samples_pico_tiny_*.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    scored = 0
    for sample in map(json.loads, samples.read_text().splitlines()):
        for args, ((loglikelihood, _),) in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            # lm-eval's own split: the whole text's tokens, the context's count of them first
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            start = len(tokenizer(context, add_special_tokens=False).input_ids)
            expected = hf(whole)[start - 1 :].gather(1, torch.tensor(whole[start:])[:, None]).sum().item()
            assert float(loglikelihood) == pytest.approx(expected, abs=1e-3)
            scored += 1
    assert scored == sum(len(doc["choices"]) for doc in DOCS)
