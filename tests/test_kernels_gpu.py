"""Triton kernels on the GPU in bfloat16 at Qwen2.5-1.5B shapes, against the float32 torch references."""

from __future__ import annotations

import pytest
import torch

from kernels import arrivals, decode_attention
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.attention_tile import paged_attention_ref
from kernels.decode_attention import rope_store_decode_attention
from kernels.kv_store import make_cos_sin, rope_store_kv, rope_store_kv_ref
from kernels.norm import add_rms_norm, rms_norm, rms_norm_ref
from kernels.prefill_attention import paged_prefill_attention, prefill_work
from kernels.sampling import _gumbel_argmax_kernel, gumbel_argmax, gumbel_argmax_ref
from tests.test_kernels import decode_ref, decode_triton, no_new_kv

pytestmark = pytest.mark.gpu

HIDDEN, HQ, HKV, D, INTER, BLOCK = 1536, 12, 2, 128, 8960, 16
BF16 = torch.bfloat16


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2) -> None:
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
    assert err <= tol, f"relative error {err:.2e} > {tol}"


def fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


def qkv_views(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = torch.randn(num_tokens, (HQ + 2 * HKV) * D, device="cuda", dtype=BF16)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    return q.view(num_tokens, HQ, D), k.view(num_tokens, HKV, D), v.view(num_tokens, HKV, D)


def work_on_gpu(qlens: list[int], group: int) -> torch.Tensor:
    return torch.from_numpy(prefill_work(qlens, group)).cuda()


def paged_cache(lens: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    needed = [(n + BLOCK - 1) // BLOCK for n in lens]
    num_blocks = sum(needed) + 1
    ids = torch.randperm(num_blocks, device="cuda").int()
    tables = torch.zeros((len(lens), width), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(needed):
        tables[b, :n] = ids[start : start + n]
        start += n
    k_cache = torch.randn(num_blocks, HKV, BLOCK, D, device="cuda", dtype=BF16)
    return k_cache, torch.randn_like(k_cache), tables


def test_rms_norm_and_add_rms_norm_bf16():
    x, res = torch.randn(2, 300, HIDDEN, device="cuda", dtype=BF16)
    w = torch.rand(HIDDEN, device="cuda", dtype=BF16) + 0.5
    assert_close_rel(rms_norm(x, w, 1e-6), rms_norm_ref(*fp32(x, w), 1e-6))
    out, new_res = add_rms_norm(x, res, w, 1e-6)
    ref_res = x.float() + res.float()
    ref_out = rms_norm_ref(ref_res, w.float(), 1e-6)
    assert_close_rel(out, ref_out)
    assert_close_rel(new_res, ref_res)


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_gumbel_argmax_at_qwen_vocab_equals_reference(rows):
    # Seeded: the kernel's fast log differs from torch.log by ~2^-22, so only a near-tie could split them, and
    # these inputs then do so every run or never.
    torch.manual_seed(rows)
    vocab = 151936
    logits = torch.randn(rows, vocab, device="cuda") * 4
    temps = torch.rand(rows, device="cuda") * 1.5
    temps[::3] = 0.0
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), device="cuda", dtype=torch.int64)
    positions = torch.randint(0, 32768, (rows,), device="cuda", dtype=torch.int64)
    out = gumbel_argmax(logits, temps, seeds, positions)
    assert torch.equal(out, gumbel_argmax_ref(logits, temps, seeds, positions))


def test_gumbel_argmax_on_bf16_logits_compiles_once_for_every_batch_size():
    # The engine's logits are bf16; a new compile per batch size stalled serving for ~0.5 s each time.
    def sample(rows: int) -> None:
        logits = torch.randn(rows, 151936, device="cuda", dtype=BF16) * 4
        ones = torch.ones(rows, device="cuda")
        ids = torch.arange(rows, device="cuda")
        out = gumbel_argmax(logits, ones, ids, ids)
        assert torch.equal(out, gumbel_argmax_ref(logits, ones, ids, ids))

    sample(1)
    compiled = _gumbel_argmax_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(compiled)
    for rows in (2, 7, 8, 33, 100, 263, 300):
        sample(rows)
    assert len(compiled) == before


def test_silu_and_mul_bf16():
    x = torch.randn(300, 2 * INTER, device="cuda", dtype=BF16)
    assert_close_rel(silu_and_mul(x), silu_and_mul_ref(x.float()))


def test_rope_store_kv_bf16_from_fused_qkv():
    q, k, v = qkv_views(257)
    pos = torch.randint(0, 32768, (257,), device="cuda")
    slots = torch.randperm(64 * BLOCK, device="cuda")[:257]
    slots[::7] = -1
    cos_sin = make_cos_sin(32768, D, 1e6, "cuda")
    k_cache, v_cache = (torch.zeros(64, HKV, BLOCK, D, device="cuda", dtype=BF16) for _ in range(2))
    ref_k, ref_v = torch.zeros_like(k_cache, dtype=torch.float32), torch.zeros_like(v_cache, dtype=torch.float32)
    q_rot = rope_store_kv(q, k, v, pos, cos_sin, k_cache, v_cache, slots)
    ref_q = rope_store_kv_ref(*fp32(q, k, v), pos, cos_sin, ref_k, ref_v, slots)
    assert_close_rel(q_rot, ref_q)
    assert_close_rel(k_cache, ref_k)
    assert_close_rel(v_cache, ref_v)


def test_decode_attention_bf16_long_contexts():
    lens = [32768, 0, 1, 16, 1000, 17, 20000, 4095]
    k_cache, v_cache, tables = paged_cache(lens, width=32768 // BLOCK)
    q = qkv_views(len(lens))[0]
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = decode_triton(q, k_cache, v_cache, tables, ctx, D**-0.5)
    ref = decode_ref(*fp32(q, k_cache, v_cache), tables, ctx, D**-0.5)
    assert_close_rel(out, ref)
    assert out[1].abs().max() == 0


@pytest.mark.parametrize("lens", [[1, 0, 300, 64, 65, 5000], [32768]], ids=["batch-6", "batch-1-32k"])
def test_decode_attention_rotating_and_storing_the_steps_kv_bf16(lens):
    k_cache, v_cache, tables = paged_cache(lens, width=32768 // BLOCK)
    q, k, v = qkv_views(len(lens))
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    positions = (ctx - 1).clamp(min=0).long()
    slots = torch.tensor(
        [int(tables[b, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK if n else -1 for b, n in enumerate(lens)],
        device="cuda",
    )
    cos_sin = make_cos_sin(32768, D, 1e6, "cuda")
    k_ref, v_ref = fp32(k_cache, v_cache)
    q_ref = rope_store_kv_ref(*fp32(q, k, v), positions, cos_sin, k_ref, v_ref, slots)
    new_kv = decode_attention.NewTokenKV(k, v, positions, cos_sin, slots)
    out = rope_store_decode_attention(q, new_kv, k_cache, v_cache, tables, ctx, D**-0.5)
    assert_close_rel(out, decode_ref(q_ref, k_ref, v_ref, tables, ctx, D**-0.5))
    assert_close_rel(k_cache, k_ref) and torch.equal(v_cache.float(), v_ref)


@pytest.mark.parametrize("one_level", [32, 4], ids=["one-level", "tree"])
def test_decode_attention_replays_in_a_cuda_graph_with_new_lengths(one_level, monkeypatch):
    # 4 rows x 2 KV heads (the few-rows launch): 32 splits of 128 in the grid; 4096 tokens take all 32, 3000 24,
    # 100 two. One level up to 32, or a tree of groups of 4 past 4 (4096: 8 groups, the top takes their 8).
    monkeypatch.setattr(decode_attention, "_SPLIT_GROUP", 4)
    monkeypatch.setattr(decode_attention, "_FEW_ROWS_ONE_LEVEL", one_level)
    k_cache, v_cache, tables = paged_cache([4096] * 4, width=4096 // BLOCK)
    q = torch.randn(4, HQ, D, device="cuda", dtype=BF16)
    ctx = torch.tensor([4096, 1, 100, 0], dtype=torch.int32, device="cuda")
    new_kv = no_new_kv(q, k_cache)
    rope_store_decode_attention(q, new_kv, k_cache, v_cache, tables, ctx, 0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope_store_decode_attention(q, new_kv, k_cache, v_cache, tables, ctx, 0.1)
    ctx.copy_(torch.tensor([7, 3000, 0, 4096], dtype=torch.int32))
    graph.replay()
    assert_close_rel(out, decode_ref(*fp32(q, k_cache, v_cache), tables, ctx, 0.1))
    # The combine reads its splits in order whichever program arrives last: a replay equals an eager call bit for
    # bit, and every arrival counter is back at zero after each.
    assert torch.equal(out, rope_store_decode_attention(q, new_kv, k_cache, v_cache, tables, ctx, 0.1))
    assert not arrivals._arrivals[q.device].any()


def test_decode_attention_capture_without_an_eager_call_of_its_size_is_refused(monkeypatch):
    monkeypatch.setattr(arrivals, "_arrivals", {})  # as if no eager call had run on this device
    k_cache, v_cache, tables = paged_cache([100], width=512 // BLOCK)
    q = torch.randn(1, HQ, D, device="cuda", dtype=BF16)
    ctx = torch.tensor([100], dtype=torch.int32, device="cuda")
    new_kv = no_new_kv(q, k_cache)
    with pytest.raises(RuntimeError, match="make the same call eagerly before capturing it"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            rope_store_decode_attention(q, new_kv, k_cache, v_cache, tables, ctx, 0.1)


def test_prefill_attention_bf16_with_cached_prefixes():
    lens, qlens = [1000, 4096, 17, 2500, 300], [1000, 512, 17, 1, 45]
    k_cache, v_cache, tables = paged_cache(lens, width=4096 // BLOCK)
    q = qkv_views(sum(qlens))[0]
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, D**-0.5, work_on_gpu(qlens, HQ // HKV))
    ref = paged_attention_ref(*fp32(q, k_cache, v_cache), tables, cu, ctx, D**-0.5)
    assert_close_rel(out, ref)


@pytest.mark.parametrize("block, hq, hkv", [(8, 12, 2), (128, 12, 2), (16, 28, 4), (64, 28, 4)])
def test_attention_bf16_at_other_block_sizes_and_qwen_7b_heads(block, hq, hkv):
    """Block sizes the config allows besides 16, and 7B's 7 query heads per KV head, around split edges."""
    lens, qlens = [255, 256, 257, 1, 4097], [255, 3, 1, 1, 100]
    blocks_of = [-(-n // block) for n in lens]
    ids = torch.randperm(sum(blocks_of), device="cuda").int()
    tables = torch.zeros(len(lens), max(blocks_of), dtype=torch.int32, device="cuda")
    for b, start in enumerate(torch.tensor([0, *blocks_of]).cumsum(0)[:-1].tolist()):
        tables[b, : blocks_of[b]] = ids[start : start + blocks_of[b]]
    k_cache, v_cache = (torch.randn(sum(blocks_of), hkv, block, D, device="cuda", dtype=BF16) for _ in range(2))
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), hq, D, device="cuda", dtype=BF16)
    assert_close_rel(
        decode_triton(q, k_cache, v_cache, tables, ctx, D**-0.5),
        decode_ref(*fp32(q, k_cache, v_cache), tables, ctx, D**-0.5),
    )
    qp = torch.randn(sum(qlens), hq, D, device="cuda", dtype=BF16)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    assert_close_rel(
        paged_prefill_attention(qp, k_cache, v_cache, tables, cu, ctx, D**-0.5, work_on_gpu(qlens, hq // hkv)),
        paged_attention_ref(*fp32(qp, k_cache, v_cache), tables, cu, ctx, D**-0.5),
    )


def test_kernels_address_a_cache_larger_than_int32_offsets():
    num_blocks = 2**31 // (HKV * BLOCK * D) + 8  # element offsets of the last blocks exceed 2^31
    k_cache, v_cache = (torch.zeros(num_blocks, HKV, BLOCK, D, device="cuda", dtype=BF16) for _ in range(2))
    q, k, v = qkv_views(BLOCK)
    last = num_blocks - 1
    zeros = torch.zeros(BLOCK, dtype=torch.int64, device="cuda")  # position 0: RoPE leaves k as it is
    rope_store_kv(
        q,
        k,
        v,
        zeros,
        make_cos_sin(1, D, 1e6, "cuda"),
        k_cache,
        v_cache,
        torch.arange(BLOCK, device="cuda") + last * BLOCK,
    )
    assert torch.equal(k_cache[last], k.transpose(0, 1)) and torch.equal(v_cache[last], v.transpose(0, 1))
    q = torch.randn(1, HQ, D, device="cuda", dtype=BF16)
    tables = torch.tensor([[last]], dtype=torch.int32, device="cuda")
    ctx = torch.tensor([BLOCK], dtype=torch.int32, device="cuda")
    out = decode_triton(q, k_cache, v_cache, tables, ctx, 0.1)
    ref = decode_ref(*fp32(q, k_cache[last:], v_cache[last:]), tables - last, ctx, 0.1)
    assert_close_rel(out, ref)
    cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    work = work_on_gpu([1], HQ // HKV)
    assert_close_rel(paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 0.1, work), ref)
