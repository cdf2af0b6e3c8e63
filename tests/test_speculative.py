"""Speculative decoding (n-gram drafts) is greedy-exact: with it, every request gets Hugging Face's greedy tokens,
across batching, chunked prefill, preemption, prefix-cache hits, stop strings and aborts; drafts are counted."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from safetensors.torch import load_file, save_file
from test_overlapped_plans import _check_against_hf, _workload
from transformers import AutoModelForCausalLM

from frontend import LLM, AsyncLLM, SamplingParams
from protocol.config import EngineConfig, InvalidParam
from scheduler.speculation import NgramDrafter, accepted_count

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _hf_greedy(ckpt, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def oracle_drafts(tiny_ckpt, monkeypatch):
    """Drafts from the true greedy continuation with every third token wrong and every fourth lookup empty: each
    verify accepts some, rejects the rest, or resets a row without drafts."""
    prompts, max_tokens = _workload()
    refs = [p + _hf_greedy(tiny_ckpt, p, m) for p, m in zip(prompts, max_tokens)]
    proposed = []

    def propose(self, longest: int, shortest: int, k: int) -> list[int]:
        seq = self.tokens[: self.size].tolist()
        ref = next(r for r in refs if r[: len(seq)] == seq)
        if len(seq) % 4 == 0:
            return []
        draft = [(t + 1) % 500 if (len(seq) + j) % 3 == 0 else t for j, t in enumerate(ref[len(seq) : len(seq) + k])]
        proposed.append(draft)
        return draft

    monkeypatch.setattr(NgramDrafter, "propose", propose)
    return proposed


def test_verified_drafts_with_reuse_preemption_prefix_hits_and_abort_equal_hf(tiny_ckpt, oracle_drafts):
    _check_against_hf(tiny_ckpt, "cpu", speculative_config=SPEC)
    drafted = [t for draft in oracle_drafts for t in draft]
    assert len(oracle_drafts) > 20 and len(drafted) > 40  # the rows drafted, and the checks above held


@pytest.mark.gpu
def test_verified_drafts_on_cuda_graphs_equal_hf(tiny_ckpt, oracle_drafts):
    _check_against_hf(tiny_ckpt, "cuda", enforce_eager=False, speculative_config=SPEC)
    assert len(oracle_drafts) > 20


@pytest.fixture(scope="module")
def chain_ckpt(tmp_path_factory):
    """A model whose attention adds nothing (o_proj zero): its next token depends on the current one alone, so its
    greedy text is a chain that prompt lookup predicts once the prompt holds it."""
    ckpt = make_checkpoint(tmp_path_factory.mktemp("chain"))
    for path in ckpt.glob("*.safetensors"):
        weights = load_file(path)
        save_file({k: v * 0 if "o_proj" in k else v for k, v in weights.items()}, path, metadata={"format": "pt"})
    return ckpt


@pytest.fixture(scope="module")
def copy_prompts(chain_ckpt) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts that end inside a text they already hold (a chain, then its start again), and HF's continuations."""
    prompts = []
    for start in (5, 77, 300):
        chain = [start, *_hf_greedy(chain_ckpt, [start], 59)]
        prompts.append(chain + chain[: 8 + start % 5])
    return prompts, [_hf_greedy(chain_ckpt, p, 40) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _assert_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 24, "block_size": 8}],
    ids=["batched", "chunked-prefill", "preempted"],
)
def test_prompt_lookup_drafts_are_accepted_and_exact(chain_ckpt, copy_prompts, engine):
    prompts, expected = copy_prompts
    with LLM(str(chain_ckpt), device="cpu", speculative_config=SPEC, **engine) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # a prefix-cache hit
        stats = llm.stats()
        _assert_blocks_free(llm)
    assert got == expected and again == expected[0]
    assert stats["spec_num_accepted_tokens"] > 0.8 * stats["spec_num_draft_tokens"] > 0
    assert stats["spec_accepted_per_pos"][0] >= stats["spec_accepted_per_pos"][-1] > 0
    if "num_kv_blocks" in engine:
        assert stats["num_preemptions"] > 0


def test_stop_strings_and_max_tokens_see_the_tokens_a_plain_run_would(chain_ckpt, copy_prompts):
    prompts, _ = copy_prompts
    with LLM(str(chain_ckpt), device="cpu") as llm:
        plain = llm.generate(prompts, GREEDY, use_tqdm=False)
        stop = [o.outputs[0].text[10:13] for o in plain]  # a text the answer reaches mid-draft
        params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[s]) for s in stop]
        short = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
        plain_stop, plain_short = (
            llm.generate(prompts, params, use_tqdm=False),
            llm.generate(prompts, short, use_tqdm=False),
        )
    with LLM(str(chain_ckpt), device="cpu", speculative_config=SPEC) as llm:
        spec_stop, spec_short = (
            llm.generate(prompts, params, use_tqdm=False),
            llm.generate(prompts, short, use_tqdm=False),
        )
        assert llm.stats()["spec_num_accepted_tokens"] > 0
    for a, b in zip(plain_stop + plain_short, spec_stop + spec_short):
        ours, theirs = a.outputs[0], b.outputs[0]
        assert (ours.text, ours.token_ids, ours.finish_reason) == (theirs.text, theirs.token_ids, theirs.finish_reason)


def test_an_abort_mid_draft_frees_its_blocks(chain_ckpt, copy_prompts):
    engine = AsyncLLM(str(chain_ckpt), device="cpu", speculative_config=SPEC)

    async def run() -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
        async for out in engine.generate(copy_prompts[0][0], params, "long"):
            if len(out.outputs[0].token_ids) > 12:
                break  # leaving the loop aborts the request
        finals = [o async for o in engine.generate(copy_prompts[0][1][:5], GREEDY, "next")]
        assert finals[-1].finished and len(finals[-1].outputs[0].token_ids) == 40
        return await engine.get_stats()

    try:
        stats = asyncio.run(run())
    finally:
        engine.shutdown()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["spec_num_drafts"] > 0


def test_ngram_lookup_takes_the_longest_then_latest_match():
    drafter = NgramDrafter([1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3])
    assert drafter.propose(3, 1, 2) == [9, 9]  # "1 2 3" occurs once before the end
    assert drafter.propose(2, 1, 3) == [7, 8, 1]  # "2 3": the latest earlier occurrence
    assert drafter.propose(3, 3, 9) == [9, 9, 2, 3, 7, 8, 1, 2, 3]
    assert NgramDrafter([4, 5, 6]).propose(3, 1, 4) == []
    assert accepted_count([5, 6, 7], np.array([5, 6, 8, 1])) == 2 and accepted_count([5], np.array([4, 4])) == 0


def test_a_request_whose_drafts_gain_nothing_stops_drafting():
    drafter = NgramDrafter([1, 2, 1])
    assert [drafter.settle(0) for _ in range(3)] == [True, True, False]


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"method": "eagle"}, "speculative_config.method"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"prompt_lookup_max": 2, "prompt_lookup_min": 3}, "speculative_config.prompt_lookup_min"),
        ({"num_speculative_token": 3}, "speculative_config"),
        ("ngram", "speculative_config"),
    ],
)
def test_a_bad_speculative_config_is_a_value_error_naming_the_key(spec, field):
    with pytest.raises(InvalidParam, match=field) as exc:
        EngineConfig(model="m", speculative_config=spec)
    assert exc.value.field == field
