"""Prompt logprobs (SamplingParams.prompt_logprobs) through the whole engine, against Hugging Face's log-softmax of
the same prompt: across chunked prefill, preemption, a prefix-cache hit and n samples."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from frontend import LLM, SamplingParams
from protocol.config import InvalidParam

K = 3
PROMPT_LENS = [1, 2, 17, 40, 77]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_ckpt) -> list[torch.Tensor]:
    """Per prompt, [n - 1, vocab]: row i is the log-softmax that predicts prompt token i + 1."""
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), -1) for p in _prompts()]


def _assert_matches_hf(output, expected: torch.Tensor, k: int = K) -> None:
    prompt = output.prompt_token_ids
    assert output.prompt_logprobs[0] is None and output.prompt_ranks[0] is None
    assert len(output.prompt_logprobs) == len(output.prompt_ranks) == len(prompt)
    for i, (entry, rank) in enumerate(zip(output.prompt_logprobs[1:], output.prompt_ranks[1:])):
        row, token = expected[i], prompt[i + 1]
        assert set(entry) == {token, *row.topk(k).indices.tolist()}
        for t, lp in entry.items():
            assert lp == pytest.approx(row[t].item(), abs=1e-4)
        assert rank == int((row > row[token]).sum()) + 1


def _check(llm: LLM, hf_logprobs, params: SamplingParams) -> None:
    outputs = llm.generate(_prompts(), params, use_tqdm=False)
    for output, expected in zip(outputs, hf_logprobs):
        _assert_matches_hf(output, expected)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


PARAMS = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=K, ignore_eos=True)


def test_prompt_logprobs_equal_hf_across_chunks_and_a_prefix_cache_hit(tiny_ckpt, hf_logprobs):
    with LLM(str(tiny_ckpt), device="cpu", max_num_batched_tokens=16, block_size=8) as llm:
        _check(llm, hf_logprobs, PARAMS)
        _check(llm, hf_logprobs, PARAMS)  # the prompts' blocks are cached now: prompt logprobs skip the cache
        plain = llm.generate(_prompts(), SamplingParams(max_tokens=1), use_tqdm=False)
        assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_survive_preemption(tiny_ckpt, hf_logprobs):
    with LLM(str(tiny_ckpt), device="cpu", num_kv_blocks=20, block_size=8, max_num_batched_tokens=24) as llm:
        _check(llm, hf_logprobs, SamplingParams(temperature=0.0, max_tokens=40, prompt_logprobs=K, ignore_eos=True))
        assert llm.stats()["num_preemptions"] > 0


def test_prompt_logprobs_under_tensor_parallel_equal_hf(tiny_ckpt, hf_logprobs):
    with LLM(str(tiny_ckpt), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=32) as llm:
        _check(llm, hf_logprobs, PARAMS)  # each rank computes its vocab slice of the logits


def test_only_the_first_of_n_samples_computes_them_and_zero_gives_the_token_alone(tiny_ckpt, hf_logprobs):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        params = SamplingParams(temperature=1.0, n=2, max_tokens=2, prompt_logprobs=0, seed=3)
        (output,) = llm.generate(_prompts()[3:4], params, use_tqdm=False)
        _assert_matches_hf(output, hf_logprobs[3], k=0)
        assert all(len(entry) == 1 for entry in output.prompt_logprobs[1:])


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_is_a_value_error_naming_it(bad):
    with pytest.raises(InvalidParam, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
