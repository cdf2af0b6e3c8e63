"""The real Scheduler driving a ModelRunner with two plans in flight, as the engine runs them: rows freed and
reused, prefix-cache hits, preemptions and an abort, every request still Hugging Face's greedy tokens."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from frontend.model_resolution import resolve_config
from protocol.config import EngineConfig
from protocol.messages import AddRequest, i32
from protocol.sampling import SamplingParams
from scheduler.scheduler import Scheduler
from worker.attention import AttentionBackend
from worker.input_buffers import StepBuffers
from worker.startup import build_runner

ABORTED = 3  # the request aborted after a few steps: its tokens so far must still be right


def _workload() -> tuple[list[list[int]], list[int]]:
    """Prompts that share prefixes (of one block, two blocks, all of one) and their max_tokens."""
    rng = np.random.default_rng(5)
    base = rng.integers(3, 500, 24).tolist()
    tails = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(1, 12, 10)]
    prompts = [base[:k] + tail for k, tail in zip((24, 16, 8, 0, 24, 16, 0, 24, 8, 0), tails)]
    return prompts + [base, base], [int(n) for n in rng.integers(2, 14, len(prompts) + 2)]


def _serve(config: EngineConfig, prompts: list[list[int]], max_tokens: list[int]) -> tuple[dict, Scheduler]:
    """Requests arrive over the first steps; plan N+1 is launched before step N is collected."""
    runner = build_runner(config)
    sched = Scheduler(config, runner.num_kv_blocks)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    arriving, in_flight, step = deque(enumerate(prompts)), deque(), 0
    while arriving or sched.has_work() or in_flight:
        step += 1
        for _ in range(2 if step % 3 else 0):
            if arriving:
                i, prompt = arriving.popleft()
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
                assert not sched.add_request(AddRequest(str(i), i32(prompt), params.to_dict()), b"c")
        if step == 6:
            sched.abort([str(ABORTED)], b"c")
        while len(in_flight) < 2 and sched.has_work() and (plan := sched.schedule()) is not None:
            in_flight.append(runner.launch(plan))
        if in_flight:
            for _, batch in sched.on_result(runner.collect(in_flight.popleft())):
                for rid, token in zip(batch.request_ids, batch.token_ids.tolist()):
                    if token >= 0:
                        out[int(rid)].append(token)
    return out, sched


def _check_against_hf(tiny_ckpt, device: str, **kw) -> None:
    config = resolve_config(
        EngineConfig(
            model=str(tiny_ckpt),
            device=device,
            dtype="float32",
            block_size=8,
            num_kv_blocks=11,
            max_num_seqs=4,
            max_num_batched_tokens=12,
            max_model_len=64,
            **kw,
        )
    )
    prompts, max_tokens = _workload()
    out, sched = _serve(config, prompts, max_tokens)
    assert sched.num_preemptions > 0 and sched.block_manager.num_cached_tokens > 0  # the workload did its job
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).to(device).eval()
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt], device=device),
                max_new_tokens=max_tokens[i],
                min_new_tokens=max_tokens[i],
                do_sample=False,
            )[0, len(prompt) :].tolist()
        assert out[i] == (ref[: len(out[i])] if i == ABORTED else ref), f"request {i}"


@pytest.fixture(params=["qwen2", "qwen3", "llama"])
def family_ckpt(request, tiny_ckpt, tmp_path):
    """The tiny Qwen2 checkpoint, or one of Qwen3 / Llama 3 with head_dim 32 (not hidden / heads)."""
    from checkpoints import make_checkpoint

    return tiny_ckpt if request.param == "qwen2" else make_checkpoint(tmp_path, family=request.param, head_dim=32)


def test_two_plans_in_flight_with_reuse_preemption_prefix_hits_and_abort_equal_hf_greedy(family_ckpt):
    _check_against_hf(family_ckpt, "cpu")


@pytest.mark.gpu
def test_same_workload_on_cuda_with_decode_graphs_equals_hf_greedy(family_ckpt):
    _check_against_hf(family_ckpt, "cuda", enforce_eager=False)


@pytest.mark.parametrize("sizes", [(1, 1, 1, 0, 0), (3, 2, 1, 5, 3), (517, 7, 3, 9, 31), (8192, 255, 13, 1, 645)])
def test_every_staged_field_starts_16_byte_aligned_whatever_the_step_sizes(sizes):
    # Triton compiles a kernel variant per alignment class of each pointer: fields that moved between
    # 8- and 16-byte alignment with the step's sizes made eager steps compile in the middle of serving.
    backend = AttentionBackend(torch.zeros(257, 8, dtype=torch.int32), num_kv_heads=2, gqa_group=6, max_batch=256)
    buffers = StepBuffers(8192, 256, 64, backend, torch.device("cpu"))
    buffers.stage(*sizes)
    for name in (
        "rows",
        "positions",
        "slot_mapping",
        "context_lens",
        "cu_seqlens_q",
        "input_ids",
        "work",
        "sample_idx",
        "sample_rows",
        "sample_pos",
        "delta_idx",
        "delta_val",
    ):
        assert buffers.view(name).data_ptr() % 16 == 0, name
