"""Edge cases the engine can produce, for the Triton kernels (TRITON_INTERPRET=1 on CPU) against their torch
references and the references against dense math: every allowed block size, GQA groups 1..7, lengths at
split-K partition and key-tile boundaries, chunks starting mid-block, cache offsets past 2**31 elements,
and the GEMV's own split-K configs at ragged shapes. The interpreter's tl.dot reads bfloat16 as raw integer
bits, so the Triton attention and GEMV kernels are checked here in float32 and float16 only."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import arrivals, decode_attention, gemv
from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.attention_tile import paged_attention_ref
from kernels.decode_attention import NewTokenKV, rope_store_decode_attention_triton
from kernels.gemv import GemvConfig, candidate_configs, gemv_triton
from kernels.kv_store import make_cos_sin, rope_store_kv_ref, rope_store_kv_triton
from kernels.norm import qk_rms_norm_ref
from kernels.prefill_attention import paged_prefill_attention_triton, prefill_work
from tests.test_kernels import decode_ref, decode_triton

TOL = dict(atol=2e-4, rtol=2e-4)
BLOCK_SIZES = (8, 16, 32, 64, 128)  # every block_size EngineConfig allows
# (block_size, GQA group, head_dim): each block size once, groups 1..7 across them (7 = Qwen2.5-7B's 28 / 4).
SWEEP = [(8, 7, 128), (16, 3, 64), (32, 5, 128), (64, 6, 64), (128, 1, 128), (16, 2, 128), (32, 4, 64)]


def paged_cache(
    lens: list[int], hkv: int, d: int, block_size: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches; each sequence gets shuffled blocks, its table padded with -1 one block past its need."""
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 2
    ids = torch.randperm(num_blocks)
    tables = torch.full((len(lens), max(needed) + 1), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(needed):
        tables[b, :n] = ids[start : start + n].int()
        start += n
    k_cache = torch.randn(num_blocks, hkv, block_size, d, dtype=dtype)
    return k_cache, torch.randn_like(k_cache), tables


def flat_kv(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens of one sequence as a dense [n, Hkv, D], read through its block table."""
    blocks = table[: -(-n // cache.shape[2])].long()
    return cache[blocks].transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:n]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA in float32: q[qlen, Hq, D] are the last qlen of the k/v[ctx, Hkv, D] tokens, causal."""
    group, ctx, qlen = q.shape[1] // k.shape[1], k.shape[0], q.shape[0]
    kk, vv = (x.float().transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - qlen, ctx)[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), kk, vv, attn_mask=visible, scale=scale)
    return out.transpose(0, 1)


def split_every(monkeypatch, partition: int | None) -> None:
    """Decode attention splits contexts every `partition` tokens (None: its own static choice)."""
    if partition:
        monkeypatch.setattr(decode_attention, "_partition_size", lambda *shape: partition)


def run_decode(lens: list[int], group: int, hkv: int, d: int, block_size: int, calls: int = 1) -> list[torch.Tensor]:
    """Each of `calls` calls on the same random inputs against the reference; returns their outputs."""
    k_cache, v_cache, tables = paged_cache(lens, hkv, d, block_size)
    q = torch.randn(len(lens), group * hkv, d)
    ctx = torch.tensor(lens, dtype=torch.int32)
    outs = [decode_triton(q, k_cache, v_cache, tables, ctx, d**-0.5) for _ in range(calls)]
    ref = decode_ref(q, k_cache, v_cache, tables, ctx, d**-0.5)
    for out in outs:
        torch.testing.assert_close(out, ref, **TOL)
        assert all(out[b].abs().max() == 0 for b, n in enumerate(lens) if n == 0)
    return outs


@pytest.mark.parametrize(
    "lens,group,hkv,d,block_size,partition,split_group,qk_norm",
    [
        ([0, 1, 63, 64, 65, 130], 7, 1, 64, 16, 64, None, False),  # one split, split boundaries, three splits; padding
        ([5, 0, 200, 17], 3, 2, 128, 64, None, None, False),  # the default grid, two KV heads
        ([33, 1, 96], 2, 2, 32, 8, 16, None, False),  # many short splits: the token's split is the last of six
        ([33, 1, 96, 0], 2, 2, 32, 8, 16, 2, False),  # groups of two: the token's split ends the third (96) or is alone
        ([0, 1, 63, 64, 65, 130, 7, 9, 20], 7, 1, 64, 16, 64, None, False),  # nine rows: the many-rows launch
        ([5, 0, 200, 17], 3, 2, 128, 64, None, None, True),  # Qwen3's q/k norm before RoPE, a few rows
        ([0, 1, 63, 64, 65, 130, 7, 9, 20], 2, 2, 32, 16, 64, None, True),  # and many rows
    ],
)
def test_decode_rotates_and_stores_the_steps_own_kv_as_rope_store_kv_then_attention(
    monkeypatch, lens, group, hkv, d, block_size, partition, split_group, qk_norm
):
    split_every(monkeypatch, partition)
    if split_group:  # a tree past split_group splits, at a few rows too
        monkeypatch.setattr(decode_attention, "_SPLIT_GROUP", split_group)
        monkeypatch.setattr(decode_attention, "_FEW_ROWS_ONE_LEVEL", split_group)
    k_cache, v_cache, tables = paged_cache(lens, hkv, d, block_size)
    batch, hq = len(lens), group * hkv
    qkv = torch.randn(batch, (hq + 2 * hkv) * d + 3)  # q, k, v are strided views of one row, as in the model
    q, k, v = (
        qkv[:, a * d : b * d].unflatten(1, (-1, d)) for a, b in ((0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv))
    )
    ctx = torch.tensor(lens, dtype=torch.int32)
    positions = (ctx - 1).clamp(min=0).long()
    slots = torch.tensor(
        [
            int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
            for b, n in enumerate(lens)
        ]
    )
    cos_sin = make_cos_sin(max(lens) + 1, d, 1e6, "cpu")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    norm = (torch.rand(d) + 0.5, torch.rand(d) + 0.5, 1e-6) if qk_norm else ()
    q_in, k_in = q.clone(), k.clone()
    if qk_norm:
        qk_rms_norm_ref(q_in, k_in, *norm)
    want = decode_ref(
        rope_store_kv_ref(q_in, k_in, v, positions, cos_sin, k_ref, v_ref, slots), k_ref, v_ref, tables, ctx, d**-0.5
    )
    new_kv = NewTokenKV(k, v, positions, cos_sin, slots, *norm)
    got = rope_store_decode_attention_triton(q, new_kv, k_cache, v_cache, tables, ctx, d**-0.5)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(k_cache, k_ref, **TOL)
    assert torch.equal(v_cache, v_ref)
    assert all(got[b].abs().max() == 0 for b, n in enumerate(lens) if n == 0)


def test_kernels_storing_the_steps_kv_refuse_what_they_cannot_address():
    k_cache, v_cache, tables = paged_cache([3], 1, 32, 16)
    q, kv = torch.randn(1, 2, 32), torch.randn(1, 1, 64)[..., ::2]  # a head_dim stride of 2
    ctx = torch.tensor([3], dtype=torch.int32)
    new_kv = NewTokenKV(kv, kv, ctx.long() - 1, make_cos_sin(4, 32, 1e6, "cpu"), torch.tensor([2]))
    with pytest.raises(ValueError, match="unit stride"):
        rope_store_decode_attention_triton(q, new_kv, k_cache, v_cache, tables, ctx, 1.0)
    k = torch.randn(1, 1, 32)
    half_table = make_cos_sin(4, 32, 1e6, "cpu").half()  # the kernels read the table as float32
    for call in (
        lambda: rope_store_decode_attention_triton(
            q, NewTokenKV(k, k, ctx.long() - 1, half_table, torch.tensor([2])), k_cache, v_cache, tables, ctx, 1.0
        ),
        lambda: rope_store_kv_triton(q, k, k, ctx.long() - 1, half_table, k_cache, v_cache, torch.tensor([2])),
    ):
        with pytest.raises(
            ValueError,
            match=r"float32 \[max_pos, 32\] table, got head_dims 32, 32 and cos_sin "
            r"torch.float16",
        ):
            call()


@pytest.mark.parametrize("block_size,group,d", SWEEP)
def test_decode_at_partition_and_tile_boundaries_for_every_block_size_and_group(block_size, group, d, monkeypatch):
    # Partition 64 = the kernel's key tile: 63/64/65 and 128/129 sit on and one past both boundaries;
    # empty rows between long ones.
    split_every(monkeypatch, 64)
    run_decode([0, 63, 64, 65, 1, 0, 128, 129], group, 1, d, block_size)


@pytest.mark.parametrize("partition", [16, 32, 128, None])
def test_decode_with_short_splits_and_the_default_partition(partition, monkeypatch):
    # Partition 16 < block 64: a split covers part of a block; None: the static choice (256 here).
    split_every(monkeypatch, partition)
    run_decode([0, 15, 16, 17, 255, 256, 257], 7, 2, 64, 64)


def test_decode_cuts_each_rows_context_into_the_grids_splits():
    # Tables of 5 blocks of 1024 at 4 rows: 20 splits of 256 in the grid. Each row splits its own length:
    # 1 token -> one split, 65 -> two tiles of 64, 1000 -> 16 splits of 64, 4095 -> 16 of 256 (four tiles).
    run_decode([1, 65, 1000, 4095], 3, 1, 32, 1024)


@pytest.mark.parametrize("tile", [1, 2, 4], ids=["one-split-a-step", "two-a-step", "four-a-step"])
def test_decode_combine_takes_its_splits_in_steps_of_any_size(monkeypatch, tile):
    # The tile is per thread: 6 rows x 1 KV head launch 8 warps, so 1 is 256 elements, one split of 8 heads
    # (7 padded) x 32 dims a step, 2 two; partition 16 gives 8 splits in the grid, and rows using 2, 3, 5 and
    # 7 of them end on a partial step.
    monkeypatch.setattr(decode_attention, "_COMBINE_TILE", tile)
    split_every(monkeypatch, 16)
    run_decode([0, 5, 33, 65, 100, 127], 7, 1, 32, 16)


@pytest.mark.parametrize("split_group", [2, 4])
def test_decode_combines_each_group_of_splits_then_the_groups(monkeypatch, split_group):
    # Splits of 16 tokens: rows using 3, 0, 4, 1, 5, 7 and 8 of them. Groups of 4: one level at 3 and 4, a last
    # group of one at 5, of three at 7, two whole groups at 8; groups of 2: a last group of one at 3, 5 and 7.
    # Seven rows x 2 KV heads: the many-rows launch, whose one level ends at split_group.
    monkeypatch.setattr(decode_attention, "_SPLIT_GROUP", split_group)
    run_decode_twice_in_splits_of_16(monkeypatch, [40, 0, 64, 9, 80, 100, 128], split_group)


def test_decode_at_a_few_rows_combines_up_to_its_one_level_limit_at_once_then_as_a_tree(monkeypatch):
    # Four rows x 2 KV heads (the few-rows launch), splits of 16 tokens, groups of 2, one level up to 4: rows
    # using 2 splits (the small tile), 3 and 4 (one level, the wide tile), 7 (a tree: three groups of 2 and one).
    monkeypatch.setattr(decode_attention, "_SPLIT_GROUP", 2)
    monkeypatch.setattr(decode_attention, "_FEW_ROWS_ONE_LEVEL", 4)
    run_decode_twice_in_splits_of_16(monkeypatch, [20, 40, 64, 100], 2)


def run_decode_twice_in_splits_of_16(monkeypatch, lens: list[int], split_group: int) -> None:
    split_every(monkeypatch, 16)
    first, second = run_decode(lens, 3, 2, 32, 16, calls=2)
    assert torch.equal(first, second)  # the second call found every group's and row's counter back at zero
    counters = arrivals.arrival_counters(torch.device("cpu"), 1, "test")
    assert counters.numel() >= len(lens) * 2 * (1 + decode_attention._MAX_SPLITS // split_group)
    assert not counters.any()


def test_decode_leaves_every_arrival_counter_at_zero(monkeypatch):
    # Rows of 0 (padded graph lanes), 1 (one split: no counter), 24 splits of 16, and one split short of that.
    split_every(monkeypatch, 16)
    run_decode([0, 1, 380, 0, 366], 3, 2, 32, 16)
    counters = arrivals.arrival_counters(torch.device("cpu"), 5 * 2, "test")
    assert counters.numel() >= 5 * 2 and not counters.any()


def test_decode_twice_gives_the_same_bits(monkeypatch):
    # The combine reads every split in order, whichever program arrives last: a replay equals the first call.
    split_every(monkeypatch, 32)
    first, second = run_decode([700, 0, 64, 65, 1], 2, 2, 64, 32, calls=2)
    assert torch.equal(first, second)


def test_arrival_counters_grow_outside_capture_only(monkeypatch):
    monkeypatch.setattr(arrivals, "_arrivals", {})
    monkeypatch.setattr(arrivals, "_outgrown", [])
    small = arrivals.arrival_counters(torch.device("cpu"), 4, "test")
    assert arrivals.arrival_counters(torch.device("cpu"), 3, "test") is small
    large = arrivals.arrival_counters(torch.device("cpu"), 9, "test")
    assert large.numel() == 9 and not large.any() and arrivals._outgrown == [small]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="decode attention needs 8 arrival counters on cuda:0 but has 0, and a CUDA"):
        arrivals.arrival_counters(torch.device("cuda", 0), 8, "decode attention")


def test_decode_grid_splits_a_short_max_model_len_down_to_one_tile():
    # Batch 1 on a 1,168-token grid: splits of one 64-token tile, as on the 32K grid (splits of 256 there: the
    # most the combine takes); many rows keep one split a row.
    assert decode_attention._partition_size(1, 2, 1168) == decode_attention._BLOCK_N
    assert decode_attention._partition_size(1, 2, 32768) == 32768 // decode_attention._MAX_SPLITS
    # A few rows fill one wave of the few-rows launch's programs: batch 2 x 2 KV heads x 64 splits of 512.
    assert decode_attention._partition_size(2, 2, 32768) == 32768 * 4 // decode_attention._FEW_ROWS_MAX_PROGRAMS
    assert decode_attention._partition_size(256, 2, 2048) == 2048


def test_decode_of_only_empty_rows_gives_zeros():
    k_cache, v_cache = torch.randn(2, 1, 16, 64), torch.randn(2, 1, 16, 64)
    tables = torch.full((3, 2), -1, dtype=torch.int32)
    q = torch.randn(3, 5, 64)
    ctx = torch.zeros(3, dtype=torch.int32)
    out = decode_triton(q, k_cache, v_cache, tables, ctx, 0.125)
    assert out.shape == q.shape and out.abs().max() == 0
    assert decode_ref(q, k_cache, v_cache, tables, ctx, 0.125).abs().max() == 0


def run_prefill(
    lens: list[int], qlens: list[int], group: int, hkv: int, d: int, block_size: int, dtype: torch.dtype = torch.float32
) -> None:
    k_cache, v_cache, tables = paged_cache(lens, hkv, d, block_size, dtype)
    q = torch.randn(sum(qlens), group * hkv, d, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    work = torch.from_numpy(prefill_work(qlens, group))
    out = paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu, ctx, d**-0.5, work)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, cu, ctx, d**-0.5)
    tol = TOL if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("block_size,group,d", SWEEP)
def test_prefill_varlen_batch_for_every_block_size_and_group(block_size, group, d):
    rows = 128 // group  # queries per program: a whole prompt one query longer needs a second program
    # A chunk starting mid-block, a one-token prompt, a decode row, prefixes of 64 (a key tile) and of 62 (the
    # first query one key before a tile edge: that key must stay masked for it).
    lens = [block_size + 3, 1, rows + 1, 69, 129, 200, 66, 128]
    qlens = [2, 1, rows + 1, 5, 65, 3, 4, 66]
    run_prefill(lens, qlens, group, 1, d, block_size)


def test_prefill_chunks_starting_mid_block_with_two_kv_heads_in_float16():
    # Cached prefixes of 13, 64 and 100 tokens (block 8: mid-block, on a tile edge, past one), then a
    # sequence with no queries this step between them.
    run_prefill([20, 70, 9, 101], [7, 6, 0, 1], 3, 2, 64, 8, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_references_equal_dense_causal_attention_with_cached_prefixes(dtype):
    lens, qlens, group, d = [37, 1, 130], [5, 1, 130], 7, 128
    k_cache, v_cache, tables = paged_cache(lens, 1, d, 8, dtype)
    q = torch.randn(sum(qlens), group, d, dtype=dtype)
    cu = torch.tensor([0, 5, 6, 136], dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    prefill = paged_attention_ref(q, k_cache, v_cache, tables, cu, ctx, d**-0.5)
    decode = decode_ref(q[cu[1:] - 1], k_cache, v_cache, tables, ctx, d**-0.5)
    assert prefill.dtype == decode.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for b, n in enumerate(lens):
        dense = dense_attention(
            q[cu[b] : cu[b + 1]], flat_kv(k_cache, tables[b], n), flat_kv(v_cache, tables[b], n), d**-0.5
        )
        torch.testing.assert_close(prefill[cu[b] : cu[b + 1]].float(), dense, atol=tol, rtol=tol)
        torch.testing.assert_close(decode[b].float(), dense[-1], atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_rope_store_kv_for_every_block_size_with_seven_query_heads_per_kv_head(block_size):
    hq, hkv, d, tokens = 7, 1, 128, 6
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
    q, k, v = (x.view(tokens, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    last = 3 * block_size - 1
    slots = torch.tensor([0, block_size - 1, -1, block_size, last, -1])  # block edges and skipped lanes
    pos = torch.tensor([0, 1, 2, 4095, 4096, 7])
    cos_sin = make_cos_sin(4097, d, 1e6, "cpu")
    caches = [torch.full((3, hkv, block_size, d), 7.0) for _ in range(4)]
    q_rot = rope_store_kv_triton(q, k, v, pos, cos_sin, caches[0], caches[1], slots)
    torch.testing.assert_close(q_rot, rope_store_kv_ref(q, k, v, pos, cos_sin, caches[2], caches[3], slots), **TOL)
    torch.testing.assert_close(caches[0], caches[2], **TOL)
    assert torch.equal(caches[1], caches[3]) and torch.equal(caches[3][2, :, block_size - 1], v[4])
    assert int((caches[1] != 7.0).all(-1).sum()) == 4


def test_rope_reference_matches_hugging_face_at_qwen_head_dim_and_long_positions():
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

    cfg = Qwen2Config(
        hidden_size=256, num_attention_heads=2, num_key_value_heads=1, rope_theta=1e6, max_position_embeddings=32768
    )
    q, k = torch.randn(5, 2, 128), torch.randn(5, 1, 128)
    pos = torch.tensor([0, 1, 4097, 20000, 32767])
    cos, sin = Qwen2RotaryEmbedding(cfg)(q, pos[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    k_cache, v_cache = torch.zeros(1, 1, 8, 128), torch.zeros(1, 1, 8, 128)
    q_rot = rope_store_kv_ref(q, k, k, pos, make_cos_sin(32768, 128, 1e6, "cpu"), k_cache, v_cache, torch.arange(5))
    torch.testing.assert_close(q_rot, hf_q[0].transpose(0, 1), **TOL)
    torch.testing.assert_close(k_cache[0, :, :5], hf_k[0], **TOL)


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.skipif(_memory_bytes() < 8 << 30, reason="reserves 4 GiB of address space (touches ~300 MB)")
def test_kernels_address_cache_blocks_past_two_to_the_31_elements():
    # Block 2 of a cache whose block stride is just under 2**31 starts past 2**31 elements: an int32 offset
    # would wrap. The view's storage is only reserved (torch.empty), never touched except the used blocks;
    # K and V interleave in one storage so that both share the strides the kernels require.
    hkv, bs, d, hq, tokens = 2, 16, 64, 4, 20
    stride_cb = 2**30 + 2 * hkv * bs * d
    storage = torch.empty(2 * stride_cb + 2 * hkv * bs * d, dtype=torch.float16)
    k_cache, v_cache = (
        storage[off:].as_strided((3, hkv, bs, d), (stride_cb, bs * d, d, 1)) for off in (0, hkv * bs * d)
    )
    for cache in (k_cache, v_cache):
        cache[[0, 2]] = 0
    ref_k, ref_v = torch.zeros(2, 3, hkv, bs, d, dtype=torch.float16)
    q, k, v = torch.randn(tokens, hq, d).half(), torch.randn(tokens, hkv, d).half(), torch.randn(tokens, hkv, d).half()
    pos, slots = torch.arange(tokens), torch.cat([torch.arange(32, 48), torch.arange(0, 4)])  # block 2, block 0
    cos_sin = make_cos_sin(tokens, d, 1e4, "cpu")
    q_rot = rope_store_kv_triton(q, k, v, pos, cos_sin, k_cache, v_cache, slots)
    assert torch.equal(q_rot, rope_store_kv_ref(q, k, v, pos, cos_sin, ref_k, ref_v, slots))
    assert torch.equal(k_cache[[0, 2]], ref_k[[0, 2]]) and torch.equal(v_cache[[0, 2]], ref_v[[0, 2]])
    tables, ctx = torch.tensor([[2, 0, -1]], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    half_tol = dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(
        decode_triton(q_rot[-1:], k_cache, v_cache, tables, ctx, 0.125),
        decode_ref(q_rot[-1:], ref_k, ref_v, tables, ctx, 0.125),
        **half_tol,
    )
    cu = torch.tensor([0, 7], dtype=torch.int32)
    work = torch.from_numpy(prefill_work([7], hq // hkv))
    torch.testing.assert_close(
        paged_prefill_attention_triton(q_rot[-7:], k_cache, v_cache, tables, cu, ctx, 0.125, work),
        paged_attention_ref(q_rot[-7:], ref_k, ref_v, tables, cu, ctx, 0.125),
        **half_tol,
    )


def test_gemv_candidate_configs_match_linear_for_1_to_16_rows_at_ragged_shapes():
    n, k = 45, 1000  # N not a multiple of any block_n, K not of any block_k; split-K 8, 4 and 8
    w, bias = torch.randn(n, k), torch.randn(n)
    configs = candidate_configs(n, k, num_sms=132)
    assert [c.split_k for c in configs] == [8, 4, 8]
    for m in range(1, 17):
        x = torch.randn(m, k)
        b = bias if m % 2 else None
        ref = F.linear(x, w, b)
        for cfg in configs:
            torch.testing.assert_close(gemv_triton(x, w, b, cfg), ref, atol=1e-4, rtol=1e-4)


def test_one_row_gemv_matches_linear_at_ragged_shapes_and_refuses_more_rows_or_split_k():
    n, k = 45, 1000
    w, bias = torch.randn(n, k), torch.randn(n)
    one_row = [c for c in candidate_configs(n, k, num_sms=132, rows=1) if c.one_row]
    assert len(one_row) == len(gemv._ONE_ROW_TILES) and any(c.max_regs for c in one_row)  # a capped one runs too
    assert not any(c.one_row for c in candidate_configs(n, k, num_sms=132, rows=2))
    x = torch.randn(3, 2 * k)[1:2, ::2]  # one row, column stride 2
    for cfg in [*one_row, GemvConfig(8, 256, 1, one_row=True)]:
        for b in (bias, None):
            torch.testing.assert_close(gemv_triton(x, w, b, cfg), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"exactly one row of x \(got 2\)"):
        gemv_triton(torch.randn(2, k), w, bias, one_row[0])
    with pytest.raises(ValueError, match="split_k 1, got 3"):
        gemv_triton(x, w, bias, GemvConfig(16, 128, 3, one_row=True))


def test_silu_and_mul_on_a_strided_row_view():
    x = torch.randn(4, 2 * 1030 + 9)[:, : 2 * 1030]
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **TOL)


@pytest.mark.gpu
def test_float32_attention_on_the_gpu_is_not_rounded_to_tf32():
    # dtype=float32 is allowed on the GPU; Triton's tl.dot rounds float32 inputs to TF32 by default, which
    # would make the fp32 engine differ from fp32 Hugging Face by ~1e-3 (the LEAD runs this on the H200).
    lens, group, d = [300, 77], 7, 128
    k_cache, v_cache, tables = (t.cuda() for t in paged_cache(lens, 1, d, 16))
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = 3 * torch.randn(len(lens), group, d, device="cuda")
    out = decode_triton(q, k_cache, v_cache, tables, ctx, d**-0.5)
    torch.testing.assert_close(out, decode_ref(q, k_cache, v_cache, tables, ctx, d**-0.5), atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 1, 78], dtype=torch.int32, device="cuda")
    qp = 3 * torch.randn(78, group, d, device="cuda")
    work = torch.from_numpy(prefill_work([1, 77], group)).cuda()
    out = paged_prefill_attention_triton(qp, k_cache, v_cache, tables, cu, ctx, d**-0.5, work)
    torch.testing.assert_close(
        out, paged_attention_ref(qp, k_cache, v_cache, tables, cu, ctx, d**-0.5), atol=1e-5, rtol=1e-5
    )


def test_attention_refuses_a_query_without_a_unit_stride_on_head_dim():
    k_cache, v_cache, tables = paged_cache([20], 1, 16, 16)
    q = torch.randn(1, 2, 32)[:, :, ::2]  # head_dim 16 at stride 2
    ctx = torch.tensor([20], dtype=torch.int32)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q needs a unit stride on head_dim, got strides \(64, 32, 2\)"):
        decode_triton(q, k_cache, v_cache, tables, ctx, 0.25)
    with pytest.raises(ValueError, match="q needs a unit stride on head_dim"):
        paged_prefill_attention_triton(
            q, k_cache, v_cache, tables, cu, ctx, 0.25, torch.from_numpy(prefill_work([1], 2))
        )
