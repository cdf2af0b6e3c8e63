"""The device sampler: each mode against a plain reference, and seeds that ignore the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.sampling import hashed_uniform, uniform_from_bits
from protocol.sampling import SamplingParams
from worker.sampler import Sampler

V = 64


def _sampler(rows_params: list[SamplingParams], prompts=None, outputs=None, vocab: int = V) -> Sampler:
    s = Sampler(max_rows=8, vocab_size=vocab, device=torch.device("cpu"))
    for row, params in enumerate(rows_params):
        prompt = np.asarray(prompts[row] if prompts else [], np.int32)
        out = np.asarray(outputs[row] if outputs else [], np.int32)
        s.add_row(row, params.row_sampling(), prompt, out)
    return s


def _run(s: Sampler, logits: torch.Tensor, rows, positions):
    rows_np = np.asarray(rows, np.int64)
    last = torch.zeros(8, dtype=torch.int64)
    return s(logits, torch.from_numpy(rows_np), torch.as_tensor(positions, dtype=torch.int64), rows_np, last)


def _logits(n: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits(3)
    s = _sampler([SamplingParams(temperature=0.0)] * 3)
    assert torch.equal(_run(s, logits, [0, 1, 2], [5, 5, 5]).token_ids, logits.argmax(-1))


def test_seeded_row_samples_the_same_alone_or_in_a_batch():
    logits = _logits(4)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (7, 8, 9, 10)]
    batch = _sampler(params)
    together = _run(batch, logits, [0, 1, 2, 3], [3, 4, 5, 6]).token_ids
    for i in range(4):
        alone = _sampler([params[i]])
        assert _run(alone, logits[i : i + 1], [0], [3 + i]).token_ids.item() == together[i].item()


def test_different_seeds_and_positions_draw_different_noise():
    seeds = torch.tensor([1, 2, 1], dtype=torch.int64)
    pos = torch.tensor([5, 5, 6], dtype=torch.int64)
    u = hashed_uniform(seeds, pos, 1000)
    assert (u > 0).all() and (u < 1).all()
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u, hashed_uniform(seeds, pos, 1000))


def test_uniform_from_bits_stays_inside_zero_one_at_the_extremes():
    u = uniform_from_bits(torch.tensor([0, 2**23 - 1], dtype=torch.int64))
    assert u[0] == 2.0**-24 and u[1] == 1 - 2.0**-24  # exact: the noise -log(-log(u)) stays finite
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n draws of one row at n consecutive positions (n independent samples of the same distribution)."""
    s = Sampler(max_rows=1, vocab_size=logits_row.shape[-1], device=torch.device("cpu"))
    s.add_row(0, params.row_sampling(), np.zeros(0, np.int32), np.zeros(0, np.int32))
    rows = np.zeros(n, np.int64)
    return s(
        logits_row.expand(n, -1).contiguous(),
        torch.from_numpy(rows),
        torch.arange(n),
        rows,
        torch.zeros(1, dtype=torch.int64),
    ).token_ids


def test_seeded_sampling_follows_softmax_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    tokens = _draws(probs.log(), SamplingParams(temperature=1.0, seed=3), 4000)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = _logits(4, seed=1)
    params = [
        SamplingParams(temperature=1.5, top_k=1, seed=1),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=4),
    ]
    s = _sampler(params)
    tokens = _run(s, logits[:3], [0, 1, 2], [9, 9, 9]).token_ids
    assert torch.equal(tokens, logits[:3].argmax(-1))


def test_top_k_draws_only_among_the_k_best():
    logits = _logits(1, seed=2)[0]
    tokens = _draws(logits, SamplingParams(temperature=5.0, top_k=3, seed=0), 200)
    assert set(tokens.tolist()) == set(logits.topk(3).indices.tolist())


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    tokens = _draws(probs.log(), SamplingParams(temperature=1.0, top_p=0.6, seed=5), 300)
    assert set(tokens.tolist()) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_top():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens = _draws(probs.log(), SamplingParams(temperature=1.0, min_p=0.5, seed=5), 300)
    assert set(tokens.tolist()) == {0, 1}


def test_top_k_applies_only_to_rows_that_ask_in_a_mixed_batch():
    logits = _logits(1, seed=3).expand(2, -1).contiguous()
    s = _sampler([SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=1.0, top_k=1, seed=11)])
    plain = _sampler([SamplingParams(temperature=1.0, seed=11)])
    tokens = _run(s, logits, [0, 1], [4, 4]).token_ids
    assert tokens[1] == logits[0].argmax()
    assert tokens[0] == _run(plain, logits[:1], [0], [4]).token_ids[0]


def _reference_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[-1])
    for v in range(logits.shape[-1]):
        if v in prompt or counts[v] > 0:
            out[v] = out[v] / rep if out[v] > 0 else out[v] * rep
        out[v] -= freq * counts[v] + pres * (counts[v] > 0)
    return out


def test_penalties_change_the_logits_of_seen_tokens_like_the_reference():
    vocab = 16
    logits = _logits(1, seed=4, vocab=vocab)[0]
    prompt, output = [1, 2, 3], [3, 4, 4, 5]
    s = _sampler(
        [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)],
        [prompt],
        [output],
        vocab=vocab,
    )
    got = s._apply_penalties(logits[None], torch.tensor([0]))[0]
    want = _reference_penalties(logits, prompt, output, 1.3, 0.5, 0.25)
    torch.testing.assert_close(got, want)


def test_sampled_tokens_count_toward_later_penalties():
    vocab = 8
    logits = torch.zeros(1, vocab)
    logits[0, 2] = 1.0
    s = _sampler([SamplingParams(temperature=0.0, frequency_penalty=2.0)], [[0]], [[]], vocab=vocab)
    assert _run(s, logits, [0], [1]).token_ids.item() == 2
    assert s.output_counts[0, 2].item() == 1
    assert _run(s, logits, [0], [2]).token_ids.item() != 2  # 1.0 - 2.0 * 1 < 0


def test_readded_row_forgets_the_previous_requests_tokens():
    vocab = 8
    s = _sampler([SamplingParams(temperature=0.0, presence_penalty=1.0)], [[1]], [[2, 2]], vocab=vocab)
    s.add_row(
        0,
        SamplingParams(temperature=0.0, presence_penalty=1.0).row_sampling(),
        np.array([3], np.int32),
        np.zeros(0, np.int32),
    )
    assert s.output_counts[0].sum().item() == 0
    assert s.prompt_mask[0].nonzero().flatten().tolist() == [3]


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = _logits(2, seed=5)
    s = _sampler(
        [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5), SamplingParams(temperature=1.0, seed=1)],
        [[0, 1], []],
        [[], []],
    )
    out = _run(s, logits, [0, 1], [2, 2])
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    top = ref.topk(3, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert torch.equal(out.top_ids, top.indices)


def test_no_logprobs_when_no_row_asks():
    s = _sampler([SamplingParams(temperature=0.0)])
    out = _run(s, _logits(1), [0], [1])
    assert out.logprobs is None and out.top_ids is None


@pytest.mark.parametrize("seed", [-1, 2**64 - 1, 0])
def test_any_valid_seed_is_accepted(seed):
    s = _sampler([SamplingParams(temperature=1.0, seed=seed)])
    token = _run(s, _logits(1), [0], [0]).token_ids
    assert 0 <= token.item() < V


def test_profile_runs_every_stage_and_leaves_no_row_behind():
    s = Sampler(max_rows=4, vocab_size=V, device=torch.device("cpu"))
    s.profile(_logits(4))
    assert s.plain
    assert _run(s, _logits(1), [0], [0]).logprobs is None


def test_eos_and_stop_ids_are_banned_until_min_tokens_outputs():
    # Params as the scheduler resolves them: EOS (3) joins stop_token_ids unless ignore_eos.
    s = Sampler(max_rows=4, vocab_size=V, device=torch.device("cpu"))
    prompt, no_out = np.zeros(4, np.int32), np.zeros(0, np.int32)
    s.add_row(0, SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3, 5]).row_sampling(), prompt, no_out)
    s.add_row(
        1,
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True).row_sampling(),
        prompt,
        no_out,
    )
    s.add_row(2, SamplingParams(temperature=0.0, stop_token_ids=[3, 5]).row_sampling(), prompt, no_out)
    s.add_row(
        3,
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]).row_sampling(),
        prompt,
        np.array([7, 8], np.int32),
    )  # resumed
    assert not s.plain  # the graph's draw would skip the ban
    logits = torch.zeros(4, V)
    logits[:, [3, 5, 1]] = torch.tensor([10.0, 9.0, 8.0])
    for position, expected in [(4, [1, 3, 3, 3]), (5, [1, 3, 3, 3]), (6, [3, 3, 3, 3])]:
        tokens = _run(s, logits, [0, 1, 2, 3], [position] * 4).token_ids
        assert tokens.tolist() == expected, (position, tokens)
    s.add_row(
        0, SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[3, V + 10]).row_sampling(), prompt, no_out
    )
    assert _run(s, logits[:1], [0], [4]).token_ids.item() == 5  # EOS banned; an id past the vocabulary is skipped
