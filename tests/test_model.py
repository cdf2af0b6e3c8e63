"""Our models (Qwen2, Qwen3, Llama 3) over the paged KV cache equal Hugging Face's, logit for logit and token for
token (CPU, fp32)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from frontend.model_resolution import resolve_model
from kernels import gemv as gemv_module
from kernels.gemv import GemvConfig
from kernels.prefill_attention import prefill_work
from worker import linear as linear_module
from worker.attention import AttentionMetadata
from worker.loader import init_dummy_weights, load_weights
from worker.models import Qwen2ForCausalLM, model_class

ATOL = 1e-4
# Together: tied and untied; GQA ratios 1, 2 and 6; head_dim 16 and 64; single-file and sharded;
# block sizes that the prompts (13 and more tokens) do not fill evenly.
CASES = {
    "tied-mha-d16-single-bs4": (dict(num_heads=2, num_kv_heads=2, head_dim=16, tie=True), 4),
    "untied-gqa2-d64-sharded-bs8": (dict(num_heads=4, num_kv_heads=2, head_dim=64, tie=False, sharded=True), 8),
    "tied-gqa6-d16-sharded-bs4": (dict(num_heads=6, num_kv_heads=1, head_dim=16, tie=True, sharded=True), 4),
    "untied-gqa6-d64-single-bs8": (dict(num_heads=6, num_kv_heads=1, head_dim=64, tie=False), 8),
    # Qwen3 (q/k norm, no bias) and Llama 3 (llama3 RoPE scaling, no bias): head_dim unlike hidden / heads (16).
    "qwen3-tied-gqa2-d32-single-bs4": (dict(family="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, tie=True), 4),
    "qwen3-untied-gqa3-d64-sharded-bs8": (
        dict(family="qwen3", num_heads=6, num_kv_heads=2, head_dim=64, tie=False, sharded=True),
        8,
    ),
    "llama-tied-gqa2-d32-sharded-bs4": (
        dict(family="llama", num_heads=4, num_kv_heads=2, head_dim=32, tie=True, sharded=True),
        4,
    ),
    "llama-untied-mha-d24-single-bs8": (dict(family="llama", num_heads=2, num_kv_heads=2, head_dim=24, tie=False), 8),
}


class PagedRun:
    """Drives a model as a runner would: blocks from a shuffled free list, a slot per token, metadata per step."""

    def __init__(self, model: Qwen2ForCausalLM, block_size: int, num_blocks: int = 64, seed: int = 0) -> None:
        self.device = next(model.parameters()).device
        qkv = model.model.layers[0].self_attn.qkv_proj
        kv_heads, self.group = qkv.num_kv_heads, qkv.num_heads // qkv.num_kv_heads
        shape = (num_blocks, kv_heads, block_size, model.config.head_dim)
        dtype = next(model.parameters()).dtype
        self.kv = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in model.model.layers
        ]
        self.model, self.block_size = model, block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Feed each sequence's new tokens in one flat batch; return each chunk's logits [n, V]."""
        ids, positions, meta = self.inputs(chunks)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(ids, positions, meta, self.kv))
        return list(logits.split([len(t) for t in chunks.values()]))

    def inputs(self, chunks: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Place the new tokens (allocating blocks) and build the model's inputs for them."""
        ids, positions, slots = [], [], []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            for pos in range(start, start + len(tokens)):
                if pos // self.block_size == len(table):
                    table.append(self.free.pop())
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids += tokens
            positions += range(start, start + len(tokens))
            self.lens[seq] = start + len(tokens)
        return self._tensor(ids), self._tensor(positions), self._meta(chunks, slots)

    def _tensor(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _meta(self, chunks: dict[int, list[int]], slots: list[int]) -> AttentionMetadata:
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [-1] * (width - len(self.tables[s])) for s in chunks]
        qlens = [len(t) for t in chunks.values()]
        work = None if max(qlens) == 1 else self._tensor(prefill_work(qlens, self.group).tolist(), torch.int32)
        return AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(tables, torch.int32),
            context_lens=self._tensor([self.lens[s] for s in chunks], torch.int32),
            cu_seqlens_q=self._tensor([0] + qlens, torch.int32).cumsum(0).int(),
            work=work,
        )


def build_model(model_dir: str | Path, tp_rank: int = 0, tp_size: int = 1) -> Qwen2ForCausalLM:
    config, local = resolve_model(str(model_dir))
    model = model_class(config.architecture)(config, tp_rank, tp_size)
    load_weights(model, local, tp_rank, tp_size)
    return model.eval()


def dummy_bf16_cuda_model(config) -> Qwen2ForCausalLM:
    """A model of config in bfloat16 on CUDA with dummy weights of seed 0."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = model_class(config.architecture)(config)
    finally:
        torch.set_default_dtype(torch.float32)
    init_dummy_weights(model, seed=0)
    return model.eval()


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM  # lazy: TP child processes import this module

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens], device=hf.device)).logits[0]


def tokens_for(seed: int, n: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    from checkpoints import make_checkpoint

    kwargs, block_size = CASES[request.param]
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), **kwargs)
    return build_model(path), hf_model(path), block_size


def test_prefill_logits_equal_hf(case):
    ours, hf, block_size = case
    prompt = tokens_for(1, 13)
    (logits,) = PagedRun(ours, block_size).step({0: prompt})
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_decode_token_by_token_across_blocks_equals_hf(case):
    ours, hf, block_size = case
    prompt = tokens_for(2, 3 * block_size + 3)
    run = PagedRun(ours, block_size)
    got = run.step({0: prompt[:3]})
    got += [run.step({0: [t]})[0] for t in prompt[3:]]  # one query per step: the decode kernel
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_decode_with_norm_and_swiglu_folded_into_the_gemvs_equals_hf(tiny_ckpt, monkeypatch):
    # The GPU's fused path, forced here under Triton's interpreter: layer 0's norm without a residual, split-K
    # partials of the GEMV and of the sums of squares, and the one-row kernel at decode over K tiles, its
    # programs walking several blocks (one "SM", 2 programs) for gate_up.
    ours, hf, block_size = build_model(tiny_ckpt), hf_model(tiny_ckpt), 4
    monkeypatch.setattr(gemv_module, "num_sms", lambda device: 1)
    # SwiGLU's epilogue (gate_up) takes split_k 1 only.
    split = {False: GemvConfig(32, 32, split_k=2), True: GemvConfig(32, 32, one_row=True)}
    whole = {False: GemvConfig(32, 32), True: GemvConfig(8, 32, one_row=True, per_sm=2)}
    monkeypatch.setattr(
        linear_module,
        "choice",
        lambda fold, x, w, bias: (whole if fold.endswith("swiglu") else split)[x.x.shape[0] == 1] if fold else None,
    )
    prompt = tokens_for(2, 2 * block_size + 1)
    run = PagedRun(ours, block_size)
    got = run.step({0: prompt[:3]})
    got += [run.step({0: [t]})[0] for t in prompt[3:]]
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_varlen_batch_of_prefill_chunks_and_decodes_equals_each_sequence_alone(case):
    ours, hf, block_size = case
    seqs = {0: tokens_for(3, 12), 1: tokens_for(4, 7), 2: tokens_for(5, 17)}
    steps = [  # (seq, start, end): whole prompts, partial chunks, mixed chunk+decode, then pure decode
        [(0, 0, 9), (1, 0, 3), (2, 0, 6)],
        [(0, 9, 10), (1, 3, 6), (2, 6, 14)],
        [(0, 10, 11), (1, 6, 7), (2, 14, 15)],
        [(0, 11, 12), (2, 15, 16)],
    ]
    run, got = PagedRun(ours, block_size), {s: [] for s in seqs}
    for step in steps:
        out = run.step({s: seqs[s][a:b] for s, a, b in step})
        for (s, _, _), logits in zip(step, out):
            got[s].append(logits)
    for s, tokens in seqs.items():
        n = sum(len(x) for x in got[s])
        torch.testing.assert_close(torch.cat(got[s]), hf_logits(hf, tokens[:n]), atol=ATOL, rtol=0)


def test_greedy_32_tokens_equal_hf_generate(case):
    ours, hf, block_size = case
    prompts = {0: tokens_for(6, 5), 1: tokens_for(7, 11)}
    run, out = PagedRun(ours, block_size), {s: [] for s in prompts}
    feed = prompts
    for _ in range(32):  # both sequences batched: first a varlen prefill, then decode steps of 2 rows
        logits = run.step(feed)
        feed = {s: [int(x[-1].argmax())] for s, x in zip(feed, logits)}
        for s, (tok,) in feed.items():
            out[s].append(tok)
    for s, prompt in prompts.items():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[s] == ref[0, len(prompt) :].tolist()


def test_fewer_kv_caches_than_layers_run_the_first_layers_alone(tiny_ckpt):
    # What a graph's warm-up runs: the model cut to its first layer, as Hugging Face's with one layer.
    from transformers import Qwen2ForCausalLM as HFQwen2

    ours, prompt = build_model(tiny_ckpt), tokens_for(6, 9)
    assert len(ours.model.layers) > 1
    run = PagedRun(ours, 16)
    run.kv = run.kv[:1]
    (logits,) = run.step({0: prompt})
    one_layer = HFQwen2.from_pretrained(tiny_ckpt, dtype=torch.float32, num_hidden_layers=1).eval()
    torch.testing.assert_close(logits, hf_logits(one_layer, prompt), atol=ATOL, rtol=0)
    assert not torch.allclose(logits, PagedRun(ours, 16).step({0: prompt})[0], atol=ATOL, rtol=0)


def test_rope_table_stays_float32_when_the_model_changes_dtype(tiny_ckpt):
    model = build_model(tiny_ckpt).to(torch.bfloat16)
    assert model.model.rotary.cos_sin.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_dummy_weights_are_deterministic_and_keep_bf16_logits_finite_through_28_layers():
    config, _ = resolve_model("qwen2.5-1.5b", load_format="dummy")
    # The 1.5B depth and head layout at a fraction of its width: init scales by fan-in, so the
    # growth of activations over depth does not depend on width (the full shape is checked by hand).
    config.hidden_size, config.intermediate_size, config.vocab_size = 384, 2240, 4096
    config.num_attention_heads, config.head_dim = 6, 64
    torch.set_default_dtype(torch.bfloat16)
    try:
        models = [Qwen2ForCausalLM(config) for _ in range(2)]
    finally:
        torch.set_default_dtype(torch.float32)
    for m in models:
        init_dummy_weights(m, seed=7)
    a, b = (PagedRun(m, 16).step({0: tokens_for(8, 20, 4096)})[0] for m in models)
    assert torch.equal(a, b)
    assert torch.isfinite(a).all()
    assert a.std() > 0.1 and (a.argmax(-1) != a.argmax(-1)[0]).any()  # varied, not collapsed


def _tp_rank_main(rank: int, tp_size: int, rendezvous: str, cases: list[tuple[str, int]], out_dir: str) -> None:
    """One TP rank: load its shard of each checkpoint, run a greedy batch, rank 0 saves the logits."""
    from safetensors.torch import save_file

    from worker.parallel import destroy_tp_group, init_tp_group

    torch.set_num_threads(1)
    init_tp_group(rank, tp_size, "cpu", rendezvous)
    try:
        for model_dir, block_size in cases:
            logits = _greedy_logits(build_model(model_dir, rank, tp_size), block_size)
            if rank == 0:
                save_file({"logits": logits}, os.path.join(out_dir, Path(model_dir).name + ".safetensors"))
    finally:
        destroy_tp_group()


def _greedy_logits(model: Qwen2ForCausalLM, block_size: int) -> torch.Tensor:
    """Every step's logits of a 2-sequence batch: one varlen prefill, then 6 greedy decode steps."""
    run, feed, steps = PagedRun(model, block_size), {0: tokens_for(9, 10), 1: tokens_for(10, 5)}, []
    for _ in range(7):
        logits = run.step(feed)
        steps += logits
        feed = {s: [int(x[-1].argmax())] for s, x in zip(feed, logits)}
    return torch.cat(steps)


def test_tensor_parallel_2_ranks_equal_one_rank_for_split_and_replicated_kv_heads(tmp_path):
    from checkpoints import make_checkpoint
    from safetensors.torch import load_file

    kv_heads = {
        "kv2": (4, 2, "qwen2"),
        "kv4": (8, 4, "qwen2"),
        "kv1-replicated": (4, 1, "qwen2"),
        "qwen3-kv2": (4, 2, "qwen3"),
        "llama-kv1-replicated": (4, 1, "llama"),
    }
    cases = [
        (
            str(
                make_checkpoint(
                    tmp_path / name,
                    num_heads=h,
                    num_kv_heads=kv,
                    tie=name != "kv4",
                    family=family,
                    head_dim=16 if family == "qwen2" else 32,
                )
            ),
            4,
        )
        for name, (h, kv, family) in kv_heads.items()
    ]
    torch.multiprocessing.spawn(
        _tp_rank_main, args=(2, f"file://{tmp_path}/rendezvous", cases, str(tmp_path)), nprocs=2, join=True
    )
    for model_dir, block_size in cases:
        tp2 = load_file(tmp_path / (Path(model_dir).name + ".safetensors"))["logits"]
        torch.testing.assert_close(tp2, _greedy_logits(build_model(model_dir), block_size), atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_model_on_cuda_kernels_matches_hf_on_cuda(name, tmp_path):
    from checkpoints import make_checkpoint

    kwargs, block_size = CASES[name]
    path = make_checkpoint(tmp_path, **kwargs)
    ours, hf = build_model(path).cuda(), hf_model(path).cuda()
    prompt = tokens_for(11, 3 * block_size + 3)
    run = PagedRun(ours, block_size)
    got = run.step({0: prompt[:5]}) + [run.step({0: [t]})[0] for t in prompt[5:]]
    # Triton's fp32 tl.dot rounds its inputs to TF32 on this hardware: ~1e-2 on these logits (std ~3),
    # not the CPU's 1e-4. The greedy tokens must still be the same.
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, prompt), atol=3e-2, rtol=0)
    out = [int(got[-1][-1].argmax())]  # the prompt is cached: continue greedily from its last logits
    for _ in range(31):
        out.append(int(run.step({0: out[-1:]})[0][-1].argmax()))
    ref = hf.generate(
        torch.tensor([prompt], device="cuda"), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out == ref[0, len(prompt) :].tolist()


@pytest.mark.gpu
def test_decode_forward_replays_in_a_cuda_graph(tiny_ckpt):
    model = build_model(tiny_ckpt).cuda()
    run = PagedRun(model, 8)
    run.step({0: tokens_for(12, 11), 1: tokens_for(13, 4)})
    ids, positions, meta = run.inputs({0: [5], 1: [7]})
    with torch.no_grad():
        eager = model(ids, positions, meta, run.kv).clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(ids, positions, meta, run.kv)  # warm-up (Triton compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(ids, positions, meta, run.kv)
        graph.replay()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3-1.7b", "llama-3.2-1b"])
def test_dummy_published_shapes_in_bf16_on_cuda_give_finite_varied_logits(name):
    config, _ = resolve_model(name, load_format="dummy")
    run = PagedRun(dummy_bf16_cuda_model(config), 16, num_blocks=16)
    first = run.step({0: tokens_for(14, 40, config.vocab_size)})[0]
    second = run.step({0: [int(first[-1].argmax())]})[0]
    for logits in (first, second):
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all() and logits.float().std() > 0.1
