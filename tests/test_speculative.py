"""Speculative decoding (n-gram drafts) is greedy-exact: with it, every request gets Hugging Face's greedy tokens,
across batching, chunked prefill, preemption, prefix-cache hits, stop strings and aborts; drafts are counted."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from safetensors.torch import load_file, save_file
from test_overlapped_plans import _check_against_hf, _workload
from transformers import AutoModelForCausalLM

from frontend import LLM, AsyncLLM, SamplingParams
from protocol.config import EngineConfig, InvalidParam
from scheduler.speculation import EMPTY_LOOKUP_GAIN, NgramDrafter, Speculator, accepted_count

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

    def propose(self, drafter: NgramDrafter, k: int) -> list[int]:
        seq = drafter.tokens[: drafter.size].tolist()
        ref = next(r for r in refs if r[: len(seq)] == seq)
        if len(seq) % 4 == 0:
            return []
        draft = [(t + 1) % 500 if (len(seq) + j) % 3 == 0 else t for j, t in enumerate(ref[len(seq) : len(seq) + k])]
        proposed.append(draft)
        return draft

    monkeypatch.setattr(Speculator, "propose", propose)
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


def test_suffix_drafts_replay_an_earlier_answer_exactly(tiny_ckpt):
    """A request that continues an earlier one's answer (the tiny model's text never repeats itself) drafts it
    from the finished request's tokens; its output is HF's."""
    first = [11, 200, 37, 5]
    answer = _hf_greedy(tiny_ckpt, first, 48)
    resumed = first + answer[:8]
    with LLM(str(tiny_ckpt), device="cpu", speculative_config={"method": "suffix"}) as llm:
        llm.generate([first], GREEDY, use_tqdm=False)
        before = llm.stats()["spec_num_accepted_tokens"]
        got = llm.generate([resumed], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        stats = llm.stats()
        _assert_blocks_free(llm)
    assert got == _hf_greedy(tiny_ckpt, resumed, 40)
    assert stats["spec_num_accepted_tokens"] - before >= 25  # most of the 40 tokens came as accepted drafts


def _sampled(ckpt, prompts: list[list[int]], params: list[SamplingParams], **engine) -> tuple[list, dict]:
    with LLM(str(ckpt), device="cpu", **engine) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return out, llm.stats()


def test_random_rows_with_drafts_sample_the_tokens_a_plain_run_would(chain_ckpt, copy_prompts):
    """A seeded row's draw at each place is fixed by its seed, so keeping drafts up to the first that differs
    from the draws (rejection sampling for one-token-sure drafts) changes no token."""
    prompts = copy_prompts[0] * 2
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=i, max_tokens=30, ignore_eos=True)
        for i, (t, k, p) in enumerate([(0.3, 0, 1.0), (0.6, 20, 1.0), (1.0, 0, 0.9)] * 2)
    ]
    spec = {**SPEC, "disable_by_batch_size": 16}
    plain, _ = _sampled(chain_ckpt, prompts, params)
    drafted, stats = _sampled(chain_ckpt, prompts, params, speculative_config=spec)
    assert drafted == plain
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


def test_verified_samples_follow_the_model_distribution(chain_ckpt, copy_prompts):
    """Statistically, over 300 seeds: the chain model's next token depends on the current one alone, p(b | a). In
    a drafted output, how often b is a's likeliest successor, one of the next four, or another must match what
    p(. | a) gives, within 4.5 standard errors (a draft kept past a differing draw puts b after the wrong a)."""
    temperature, seeds = 0.3, range(300)
    prompt = copy_prompts[0][0]
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=8, ignore_eos=True) for s in seeds]
    spec = {**SPEC, "disable_by_batch_size": 512}
    out, stats = _sampled(chain_ckpt, [prompt] * len(seeds), params, speculative_config=spec, max_num_seqs=512)
    assert 0 < stats["spec_num_accepted_tokens"] < 0.9 * stats["spec_num_draft_tokens"]
    model = AutoModelForCausalLM.from_pretrained(chain_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        vocab = model.config.vocab_size
        transition = torch.softmax(model(torch.arange(vocab)[:, None]).logits[:, 0] / temperature, -1)
    pairs = torch.tensor([(a, b) for o in out for a, b in zip([prompt[-1], *o], o)])
    ranks = torch.argsort(torch.argsort(transition, 1, descending=True), 1)  # rank of b in p(. | a)
    bins = torch.bucketize(ranks, torch.tensor([1, 5]), right=True)  # 0: likeliest, 1: next four, 2: the rest
    seen = torch.bincount(bins[pairs[:, 0], pairs[:, 1]], minlength=3).double()
    expected = torch.stack([(transition * (bins == i)).sum(1)[pairs[:, 0]] for i in range(3)], 1)  # per pair
    mean, var = expected.sum(0), (expected * (1 - expected)).sum(0)
    assert ((seen - mean).abs() < 4.5 * var.sqrt() + 1).all(), (seen.tolist(), mean.tolist())


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


def _speculator(**spec) -> Speculator:
    return Speculator(EngineConfig(model="m", speculative_config=spec))


def test_ngram_lookup_takes_the_longest_then_latest_match():
    drafter = NgramDrafter([1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3])
    assert _speculator(prompt_lookup_max=3, prompt_lookup_min=1).propose(drafter, 2) == [9, 9]  # once before
    assert _speculator(prompt_lookup_max=2, prompt_lookup_min=1).propose(drafter, 3) == [7, 8, 1]  # the latest
    assert _speculator(prompt_lookup_max=3).propose(drafter, 9) == [9, 9, 2, 3, 7, 8, 1, 2, 3]
    assert _speculator(prompt_lookup_min=1).propose(NgramDrafter([4, 5, 6]), 4) == []
    # a match that overlaps the end repeats its period: what followed it is the drafts' own start
    assert _speculator(prompt_lookup_min=1).propose(NgramDrafter([5, 7, 7, 7]), 4) == [7, 7, 7, 7]
    assert _speculator(prompt_lookup_min=1).propose(NgramDrafter([1, 2, 1, 2, 1]), 5) == [2, 1, 2, 1, 2]
    assert accepted_count([5, 6, 7], np.array([5, 6, 8, 1])) == 2 and accepted_count([5], np.array([4, 4])) == 0


def test_suffix_lookup_drafts_from_finished_requests_as_long_as_the_match():
    spec = _speculator(method="suffix", suffix_decoding_max_cached_requests=2)
    assert spec.config.num_speculative_tokens == 16
    finished = SimpleNamespace(token_ids=[7, 1, 2, 3, 4, 5, 6])
    spec.retire(finished)
    assert spec.propose(NgramDrafter([9, 2, 3]), 9) == [4, 5]  # a match of 2 drafts 2 (max_spec_factor 1)
    assert spec.propose(NgramDrafter([1, 2, 3]), 9) == [4, 5, 6]  # of 3, cut where the cached request ended
    assert spec.propose(NgramDrafter([3, 4, 8, 3, 4]), 9) == [8, 3]  # its own tokens win a tie
    spec.retire(SimpleNamespace(token_ids=[4, 6, 6, 1, 2]))
    assert spec.propose(NgramDrafter([4, 6, 6, 6]), 9) == [1, 2]  # unless its own would only repeat a period
    for tokens in ([8, 8], [8, 9]):
        spec.retire(SimpleNamespace(token_ids=tokens))
    assert spec.propose(NgramDrafter([1, 2, 3]), 9) == []  # evicted past max_cached_requests


def test_a_request_whose_drafts_gain_nothing_stops_drafting():
    assert NgramDrafter([1, 2, 1]).settle(0) is False  # a first draft that gains nothing
    drafter = NgramDrafter([1, 2, 1])
    assert [drafter.settle(accepted) for accepted in (2, 0, 0)] == [True, True, False]
    drafter = NgramDrafter([1, 2, 1])
    assert [drafter.settle(EMPTY_LOOKUP_GAIN) for _ in range(2)] == [True, False]  # lookups that found nothing


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"method": "eagle"}, "speculative_config.method"),
        (
            {"method": "suffix", "suffix_decoding_max_spec_factor": 0},
            "speculative_config.suffix_decoding_max_spec_factor",
        ),
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
