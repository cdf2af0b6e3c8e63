"""--tensor-parallel-size 2 on the CPU (gloo): one worker process per rank, the same tokens as one rank."""

from __future__ import annotations

import time

import pytest
from checkpoints import fp8_checkpoints, make_checkpoint
from test_engine import _alive, _hf_greedy, _kill_later, _prompts

from frontend import LLM, SamplingParams
from frontend.engine_client import EngineDeadError

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize(
    "family,kv_heads,head_dim",
    [("qwen2", 2, 16), ("qwen2", 4, 16), ("qwen2", 1, 16), ("qwen3", 2, 32), ("llama", 1, 32)],
)
def test_tp2_greedy_equals_tp1_and_hf(tmp_path, family, kv_heads, head_dim):
    ckpt = make_checkpoint(
        tmp_path, num_heads=4, num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=64, family=family
    )
    prompts = _prompts(512)[:5]
    expected = _hf_greedy(ckpt, prompts, 10)
    with LLM(str(ckpt), device="cpu", tensor_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        assert len(llm.client.procs.procs) == 3  # the scheduler and one worker per rank
    assert got == expected


@pytest.mark.parametrize("block", [None, [16, 32]], ids=["quantized-per-channel", "fp8-checkpoint-blocks"])
def test_tp2_fp8_greedy_equals_hf_on_the_quantized_twin(tmp_path, block):
    # Per channel, a row-parallel shard's rows keep the scales of the whole rows: TP=2 quantizes as TP=1 does.
    ckpt = make_checkpoint(tmp_path / "ckpt", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    twin, fp8 = fp8_checkpoints(ckpt, tmp_path, block)
    prompts = _prompts(512)[:4]
    with LLM(str(fp8 or ckpt), device="cpu", tensor_parallel_size=2, quantization="fp8") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert got == _hf_greedy(twin, prompts, 10)


def test_tp_size_that_does_not_divide_the_heads_fails_at_launch(tiny_ckpt):
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(str(tiny_ckpt), device="cpu", tensor_parallel_size=3)


def test_killed_rank_fails_pending_requests_within_5_s(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu", tensor_parallel_size=2)
    pids = [p.pid for p in llm.client.procs.procs.values()]
    killer = _kill_later(llm.client.procs.procs["worker1"].pid, 1.0)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker"):  # rank 0 may notice first, through gloo
        llm.generate([[5, 6]] * 4, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 6.0
    killer.join()
    llm.shutdown()
    for pid in pids:
        assert not _alive(pid), f"process {pid} left behind"
