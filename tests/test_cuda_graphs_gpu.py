"""On the GPU: decode steps replayed from CUDA graphs give exactly the tokens of eager steps."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from test_model_runner import MiniScheduler, _prompt

from frontend.model_resolution import resolve_config
from protocol.config import EngineConfig
from protocol.sampling import SamplingParams
from worker.cuda_graphs import graph_batch_sizes
from worker.startup import build_runner

pytestmark = pytest.mark.gpu


def _generate(
    config: EngineConfig, prompts: list[list[int]], steps: int, params=None, overlap: bool = False
) -> dict[int, list[int]]:
    runner = build_runner(resolve_config(config), rank=0, tp_size=1)
    assert ("decode" in runner.graphs.sizes) != config.enforce_eager
    sched = MiniScheduler(runner, chunk=config.max_num_batched_tokens)
    for row, prompt in enumerate(prompts):
        sched.add(row, prompt, params(row) if params else None)
    out = sched.generate(steps, overlap=overlap)
    del sched, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _graphs_vs_eager(config_kw: dict, prompts, steps: int, params=None) -> None:
    """Graphs with step N+1 launched before step N is collected, against plain eager steps."""
    graphs = _generate(EngineConfig(**config_kw, enforce_eager=False), prompts, steps, params, overlap=True)
    eager = _generate(EngineConfig(**config_kw, enforce_eager=True), prompts, steps, params)
    assert graphs == eager


def test_graph_sizes_cover_every_batch_up_to_512():
    assert graph_batch_sizes(256)[:5] == [1, 2, 4, 8, 16] and graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(3) == [1, 2, 4] and graph_batch_sizes(20)[-1] == 24
    assert graph_batch_sizes(1024)[-1] == 512


def test_tiny_checkpoint_graphs_equal_eager_and_hf(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    prompts = [_prompt(n, seed=n) for n in (3, 17, 40)]  # batch 3 replays the size-4 graph: one padded lane
    kw = dict(
        model=str(tiny_ckpt),
        device="cuda",
        dtype="float32",
        block_size=16,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=128,
    )
    graphs = _generate(EngineConfig(**kw), prompts, 20)
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).cuda().eval()
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt], device="cuda"), max_new_tokens=20, min_new_tokens=20, do_sample=False
            )
        assert graphs[row] == ref[0, len(prompt) :].tolist()
    _graphs_vs_eager(kw, prompts, 20)


def test_sampling_after_a_graph_equals_eager(tiny_ckpt):
    kw = dict(
        model=str(tiny_ckpt),
        device="cuda",
        dtype="float32",
        block_size=16,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=128,
    )
    prompts = [_prompt(n, seed=n) for n in (5, 9, 12, 30, 7)]

    def params(row: int) -> SamplingParams:
        return (
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=row, frequency_penalty=0.3, logprobs=2)
            if row % 2
            else SamplingParams(temperature=0.0)
        )

    _graphs_vs_eager(kw, prompts, 16, params)


# The last case runs batch 1 past 8,192 tokens of context, where its attention splits hold several tiles.
@pytest.mark.parametrize("batch,prompt_len,max_model_len", [(1, 32, 4096), (32, 32, 4096), (1, 8100, 16384)])
def test_qwen25_1_5b_dummy_graphs_equal_eager_over_256_steps(batch, prompt_len, max_model_len):
    kw = dict(
        model="qwen2.5-1.5b",
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        block_size=16,
        num_kv_blocks=batch * (prompt_len + 256) // 16 + 16,
        max_num_seqs=batch,
        max_num_batched_tokens=2048,
        max_model_len=max_model_len,
    )
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, 151000, prompt_len).tolist() for _ in range(batch)]
    _graphs_vs_eager(kw, prompts, 256)
