"""Every Triton kernel (under TRITON_INTERPRET=1 on CPU) against its torch reference, and the references
against independent dense computations (Hugging Face RoPE, SDPA causal attention)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import arrivals, decode_attention, sampling
from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.attention_tile import paged_attention_ref
from kernels.decode_attention import NewTokenKV, rope_store_decode_attention_triton
from kernels.embedding import embed_rows_triton
from kernels.kv_store import make_cos_sin, rope_store_kv_ref, rope_store_kv_triton
from kernels.norm import rms_norm_ref, rms_norm_triton
from kernels.prefill_attention import max_prefill_work, paged_prefill_attention_triton, prefill_work
from kernels.sampling import apply_token_bitmask_, gumbel_argmax_ref, gumbel_argmax_triton, token_bitmask_triton

TOL = dict(atol=1e-4, rtol=1e-4)
BLOCK = 16
GQA_SHAPES = [(2, 2, 64), (4, 2, 128), (6, 1, 64)]  # (Hq, Hkv, D): GQA ratios 1, 2 and 6


def qkv_views(num_tokens: int, hq: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model has them: non-contiguous views of one fused qkv projection output."""
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(num_tokens, hq, d), k.view(num_tokens, hkv, d), v.view(num_tokens, hkv, d)


def decode_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention's reference: the attention reference at one query a row."""
    cu = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, tables, cu, ctx, scale)


def no_new_kv(q: torch.Tensor, k_cache: torch.Tensor) -> NewTokenKV:
    """A step's own token that leaves decode attention as attention alone: at position 0 (RoPE is the identity),
    slot -1 (not stored)."""
    rows, dev = q.shape[0], q.device
    kv = torch.zeros(rows, k_cache.shape[1], q.shape[2], dtype=q.dtype, device=dev)
    return NewTokenKV(
        kv,
        kv,
        torch.zeros(rows, dtype=torch.int64, device=dev),
        make_cos_sin(1, q.shape[2], 1e4, dev),
        torch.full((rows,), -1, device=dev),
    )


def decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    return rope_store_decode_attention_triton(
        q, no_new_kv(q, k_cache), k_cache, v_cache, tables, ctx, scale, table_rows
    )


def paged_cache(lens: list[int], hkv: int, d: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and block tables that give each sequence shuffled blocks; unused entries are -1."""
    needed = [(n + BLOCK - 1) // BLOCK for n in lens]
    num_blocks = sum(needed) + 3
    ids = torch.randperm(num_blocks)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(needed):
        tables[b, :n] = ids[start : start + n].int()
        start += n
    k_cache = torch.randn(num_blocks, hkv, BLOCK, d)
    return k_cache, torch.randn_like(k_cache), tables


def test_rms_norm_triton_matches_reference_on_strided_rows():
    x = torch.randn(5, 200)[:, :96]  # row stride 200: a view, like a slice of a larger activation
    w = torch.randn(96)
    out, new_residual = rms_norm_triton(x, None, w, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), **TOL)
    assert new_residual is None


def test_add_rms_norm_returns_normed_sum_and_new_residual():
    x, res, w = torch.randn(7, 96), torch.randn(7, 96), torch.randn(96)
    out, new_res = rms_norm_triton(x, res, w, 1e-6)
    ref_out, ref_res = kernels.add_rms_norm(x, res, w, 1e-6)  # the CPU reference
    torch.testing.assert_close(new_res, x + res, **TOL)
    torch.testing.assert_close(new_res, ref_res, **TOL)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(ref_out, rms_norm_ref(x + res, w, 1e-6))


def test_norms_write_into_a_buffer_of_the_rows_asked_and_refuse_fewer_than_the_input():
    # worker/linear.py's padded_rows: a GEMM after the norm may run on more rows than the step has.
    x, res, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    out, new_res = rms_norm_triton(x, res, w, 1e-6, rows=13)
    assert out.shape == (13, 96) and new_res.shape == (5, 96)
    torch.testing.assert_close(out[:5], rms_norm_ref(x + res, w, 1e-6), **TOL)
    assert rms_norm_triton(x, None, w, 1e-6, rows=8)[0].shape == (8, 96)
    assert kernels.rms_norm(x, w, 1e-6, rows=8).shape == (8, 96)  # the CPU reference pads the same way
    torch.testing.assert_close(kernels.add_rms_norm(x, res, w, 1e-6, rows=9)[0][:5], out[:5], **TOL)
    with pytest.raises(ValueError, match="rows=4 is under the input's 5"):
        rms_norm_triton(x, res, w, 1e-6, rows=4)


def test_silu_and_mul_triton_matches_reference():
    x = torch.randn(3, 2 * 1100)  # > one 1024-wide column block
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **TOL)
    torch.testing.assert_close(silu_and_mul_ref(x), F.silu(x[:, :1100]) * x[:, 1100:])


def test_make_cos_sin_and_rope_match_hugging_face_qwen2():
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

    cfg = Qwen2Config(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1, rope_theta=1e6, max_position_embeddings=64
    )
    q, k, v = qkv_views(6, 2, 1, 64)
    pos = torch.tensor([0, 1, 5, 17, 40, 63])
    cos, sin = Qwen2RotaryEmbedding(cfg)(v, pos[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    k_cache, v_cache = torch.zeros(2, 1, BLOCK, 64), torch.zeros(2, 1, BLOCK, 64)
    slots = torch.arange(6) + 10
    q_rot = rope_store_kv_ref(q, k, v, pos, make_cos_sin(64, 64, 1e6, "cpu"), k_cache, v_cache, slots)
    torch.testing.assert_close(q_rot, hf_q[0].transpose(0, 1), **TOL)
    torch.testing.assert_close(k_cache[0, :, 10:], hf_k[0], **TOL)
    torch.testing.assert_close(v_cache[0, :, 10:], v.transpose(0, 1))


@pytest.mark.parametrize("hq,hkv,d", [*GQA_SHAPES, (3, 3, 24)])  # 24: head_dim padded to a power of two
def test_rope_store_kv_triton_matches_reference_and_skips_slot_minus_one(hq, hkv, d):
    q, k, v = qkv_views(9, hq, hkv, d)
    assert not k.is_contiguous() and not v.is_contiguous()
    pos = torch.randint(0, 100, (9,))
    slots = torch.tensor([0, 5, 17, -1, 18, 40, -1, 33, 3])
    cos_sin = make_cos_sin(128, d, 1e4, "cpu")
    caches = [torch.full((3, hkv, BLOCK, d), 7.0) for _ in range(4)]
    q_rot = rope_store_kv_triton(q, k, v, pos, cos_sin, caches[0], caches[1], slots)
    ref = rope_store_kv_ref(q, k, v, pos, cos_sin, caches[2], caches[3], slots)
    torch.testing.assert_close(q_rot, ref, **TOL)
    torch.testing.assert_close(caches[0], caches[2], **TOL)
    torch.testing.assert_close(caches[1], caches[3], **TOL)
    assert int((caches[1] != 7.0).all(-1).sum()) == hkv * 7  # 7 tokens stored, the two -1 lanes not


@pytest.mark.parametrize("hq,hkv,d", GQA_SHAPES)
def test_decode_triton_matches_reference_across_splits(hq, hkv, d, monkeypatch):
    lens = [80, 0, 33, 16, 1]  # on and off block boundaries, an empty (padded) row
    k_cache, v_cache, tables = paged_cache(lens, hkv, d, width=6)
    q = qkv_views(len(lens), hq, hkv, d)[0]
    ctx = torch.tensor(lens, dtype=torch.int32)
    monkeypatch.setattr(decode_attention, "_partition_size", lambda *shape: 32)  # 3 splits
    out = decode_triton(q, k_cache, v_cache, tables, ctx, 0.125)
    torch.testing.assert_close(out, decode_ref(q, k_cache, v_cache, tables, ctx, 0.125), **TOL)
    assert out[1].abs().max() == 0


@pytest.mark.parametrize("lens,hkv", [([80, 0, 33], 2), ([5, 47, 16, 1, 9, 30, 2, 64, 3], 1)])  # few rows, many
def test_decode_reads_each_rows_block_table_through_table_rows(lens, hkv):
    k_cache, v_cache, tables = paged_cache(lens, hkv, 32, width=6)
    q = qkv_views(len(lens), 2 * hkv, hkv, 32)[0]
    ctx = torch.tensor(lens, dtype=torch.int32)
    rows = torch.randperm(len(lens) + 3)[: len(lens)]  # the runner's mirror rows: any order, some unused
    whole = torch.full((len(lens) + 3, tables.shape[1]), -1, dtype=torch.int32)
    whole[rows] = tables
    want = decode_triton(q, k_cache, v_cache, tables, ctx, 0.125)
    assert torch.equal(decode_triton(q, k_cache, v_cache, whole, ctx, 0.125, table_rows=rows), want)
    cpu = kernels.rope_store_decode_attention(q, no_new_kv(q, k_cache), k_cache, v_cache, whole, ctx, 0.125, rows)
    torch.testing.assert_close(cpu, decode_ref(q, k_cache, v_cache, tables, ctx, 0.125), **TOL)


def test_embed_rows_triton_looks_up_each_rows_token():
    weight, tokens = torch.randn(50, 1100), torch.randint(0, 50, (9,))  # 1100: more than one 1024-wide block
    rows = torch.tensor([4, 0, 4, 8])  # a row may repeat (padded graph lanes all read the dummy row)
    assert torch.equal(embed_rows_triton(weight, tokens, rows), weight[tokens[rows]])
    assert torch.equal(kernels.embed_rows(weight, tokens, rows), weight[tokens[rows]])


def test_decode_triton_with_default_partition_matches_reference():
    k_cache, v_cache, tables = paged_cache([5, 47], 2, 64, width=4)
    q = torch.randn(2, 4, 64)
    ctx = torch.tensor([5, 47], dtype=torch.int32)
    torch.testing.assert_close(
        decode_triton(q, k_cache, v_cache, tables, ctx, 0.1), decode_ref(q, k_cache, v_cache, tables, ctx, 0.1), **TOL
    )


def prefill_batch(lens: list[int], qlens: list[int], hq: int, d: int) -> tuple[torch.Tensor, ...]:
    q = qkv_views(sum(qlens), hq, 1, d)[0]
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return q, cu, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("hq,hkv,d", GQA_SHAPES)
def test_prefill_triton_matches_reference_with_cached_prefix(hq, hkv, d):
    # Context lengths on and off block boundaries; new tokens after a cached prefix, a whole prompt, a
    # decode row (one query), and a prefix longer than a key tile (unmasked tiles) under several query blocks.
    lens, qlens = [37, 16, 20, 150], [5, 16, 1, 70]
    k_cache, v_cache, tables = paged_cache(lens, hkv, d, width=10)
    q, cu, ctx = prefill_batch(lens, qlens, hq, d)
    work = torch.from_numpy(prefill_work(qlens, hq // hkv))
    out = paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu, ctx, 0.125, work)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, cu, ctx, 0.125)
    torch.testing.assert_close(out, ref, **TOL)


def test_prefill_work_lists_each_sequences_query_blocks_and_bounds_them():
    # Group 6: 21 queries a program. No item for a sequence without queries this step.
    work = prefill_work([5, 0, 22, 21, 1], 6)
    assert work.dtype == np.int32 and work.tolist() == [[0, 2, 2, 3, 4], [0, 0, 1, 0, 0]]
    assert work.shape[1] <= max_prefill_work(49, 5, 6)
    with pytest.raises(ValueError, match="1 to 128 query heads per KV head, got 129"):
        prefill_work([4], 129)


def test_prefill_triton_skips_padded_work_items_and_sequences():
    # A graph's padding: work items of sequence -1, and sequences without queries (cu repeats, context 0).
    lens, qlens = [30, 9, 0, 0], [30, 2, 0, 0]
    k_cache, v_cache, tables = paged_cache(lens, 2, 64, width=4)
    q, cu, ctx = prefill_batch(lens, qlens, 4, 64)
    work = np.full((2, max_prefill_work(32, 4, 2)), -1, np.int32)
    items = prefill_work(qlens, 2)
    work[:, : items.shape[1]] = items
    out = paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu, ctx, 0.125, torch.from_numpy(work))
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, tables, cu, ctx, 0.125), **TOL)
    with pytest.raises(ValueError, match=r"contiguous \[2, W\] int32 items, got torch.int64 \(2, 3\)"):
        paged_prefill_attention_triton(
            q, k_cache, v_cache, tables, cu, ctx, 0.125, torch.zeros(2, 3, dtype=torch.int64)
        )


def test_prefill_reference_of_whole_prompts_is_causal_attention():
    lens = [9, 20]
    k_cache, v_cache, tables = paged_cache(lens, 2, 16, width=2)
    q, cu, ctx = prefill_batch(lens, lens, 4, 16)
    out = paged_attention_ref(q, k_cache, v_cache, tables, cu, ctx, 0.25)
    for b, n in enumerate(lens):
        k = k_cache[tables[b, :2].long()].permute(1, 0, 2, 3).reshape(2, -1, 16)[:, :n].repeat_interleave(2, 0)
        v = v_cache[tables[b, :2].long()].permute(1, 0, 2, 3).reshape(2, -1, 16)[:, :n].repeat_interleave(2, 0)
        qb = q[cu[b] : cu[b + 1]].transpose(0, 1)
        dense = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=0.25).transpose(0, 1)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]], dense, **TOL)


def sampling_rows(rows: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Strided logits (a view of a wider buffer) with a tie for the maximum in row 0, greedy rows at 0 and 3,
    and seeds that cover negative and > 2**62 values."""
    logits = (torch.randn(rows, vocab + 5, generator=torch.Generator().manual_seed(vocab)) * 3)[:, :vocab]
    logits[0, [7, vocab - 2]] = 100.0
    temps = torch.tensor([0.0, 0.7, 1.3, 0.0, 1.0, 0.5])[:rows]
    seeds = torch.tensor([1, -5, 2**62 + 3, 7, -(2**63), 2**63 - 1], dtype=torch.int64)[:rows]
    return logits, temps, seeds, torch.arange(rows, dtype=torch.int64) * 1000 + 3


@pytest.mark.parametrize(
    "vocab,block",
    [(1000, 512), (1000, 128), (1000, 32), (4099, 128), (300, 16)],
    ids=["1-chunk", "2-chunks", "8-chunks", "9-chunks", "5-chunks"],
)
def test_gumbel_argmax_triton_matches_reference_for_any_chunking(vocab, block, monkeypatch):
    monkeypatch.setattr(sampling, "_BLOCK", block)
    logits, temps, seeds, positions = sampling_rows(6, vocab)
    ref = gumbel_argmax_ref(logits, temps, seeds, positions)
    assert ref[0] == 7 and ref[3] == logits[3].argmax()  # greedy rows: the first of equal maxima
    assert torch.equal(gumbel_argmax_triton(logits, temps, seeds, positions), ref)


def test_gumbel_argmax_reads_row_params_through_rows_and_stores_the_last_tokens(monkeypatch):
    # The decode graph's draw: temperatures and seeds from the sampler's [rows, 6] / [rows, 3] tables (strided
    # columns), each token also stored at last_token[row]; every chunk counter back at zero afterwards.
    logits, temps, seeds, positions = sampling_rows(6, 1000)
    rows = torch.tensor([4, 0, 7, 2, 5, 1])
    floats, ints = torch.zeros(8, 6), torch.zeros(8, 3, dtype=torch.int64)
    floats[rows, 0], ints[rows, 1] = temps, seeds
    last_token = torch.full((9,), -1, dtype=torch.int64)
    monkeypatch.setattr(sampling, "_BLOCK", 128)  # two chunks a row
    out = gumbel_argmax_triton(logits, floats[:, 0], ints[:, 1], positions, rows, last_token)
    assert torch.equal(out, gumbel_argmax_ref(logits, temps, seeds, positions))
    assert torch.equal(last_token[rows], out) and (last_token[[3, 6, 8]] == -1).all()
    assert not arrivals.arrival_counters(torch.device("cpu"), 6, "test").any()
    cpu_last = torch.full((9,), -1, dtype=torch.int64)
    assert torch.equal(kernels.gumbel_argmax(logits, floats[:, 0], ints[:, 1], positions, rows, cpu_last), out)
    assert torch.equal(cpu_last, last_token)
    with pytest.raises(ValueError, match="pass rows with last_token"):
        kernels.gumbel_argmax(logits, temps, seeds, positions, last_token=cpu_last)


def test_gumbel_argmax_reference_draws_depend_on_seed_and_position_only():
    logits, temps, seeds, positions = sampling_rows(6, 500)
    batch = gumbel_argmax_ref(logits, temps, seeds, positions)
    for i in range(6):
        assert (
            gumbel_argmax_ref(logits[i : i + 1], temps[i : i + 1], seeds[i : i + 1], positions[i : i + 1]) == batch[i]
        )
    moved = gumbel_argmax_ref(logits, temps, seeds, positions + 1)
    assert not torch.equal(moved[[1, 2, 4, 5]], batch[[1, 2, 4, 5]])


def test_public_names_run_the_reference_on_cpu():
    x, w = torch.randn(2, 8), torch.randn(8)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), rtol=0, atol=0)
    torch.testing.assert_close(kernels.silu_and_mul(x), silu_and_mul_ref(x), rtol=0, atol=0)


def test_token_bitmask_triton_bans_exactly_the_zero_bits_of_each_masked_row():
    vocab, words = 100, 4  # 128 bits for 100 ids: the padding bits never reach past the vocab
    logits = torch.randn(5, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, words), dtype=torch.int32)
    lanes = torch.tensor([1, -1, -1, 0, -1], dtype=torch.int32)  # rows 0 and 3 take mask rows 1 and 0
    out = logits.clone()
    token_bitmask_triton(out, lanes, bitmask)
    ref = logits.clone()
    apply_token_bitmask_(ref, lanes, bitmask)
    allowed = ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(2, -1)[:, :vocab].bool()
    for row, m in ((0, 1), (3, 0)):
        assert torch.equal(out[row].isneginf(), ~allowed[m])
        assert torch.equal(out[row][allowed[m]], logits[row][allowed[m]])
    assert torch.equal(out, ref) and torch.equal(out[[1, 2, 4]], logits[[1, 2, 4]])  # rows without a mask untouched
