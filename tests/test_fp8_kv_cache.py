"""An FP8 (e4m3) KV cache: the store writes the references' bytes, both attention kernels read it as their torch
references do (Triton kernels under TRITON_INTERPRET=1 on CPU), and the engine's greedy tokens equal Hugging Face's
with K and V rounded to e4m3 the same way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.language as tl
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from frontend import LLM, cli
from frontend.model_resolution import config_from_dir, resolve_config
from kernels import decode_attention
from kernels.attention_tile import paged_attention_ref
from kernels.decode_attention import NewTokenKV, rope_store_decode_attention_triton
from kernels.kv_quant import E4M3_MAX, FP8_KV_DTYPE, from_cache_ref, to_cache_ref
from kernels.kv_store import make_cos_sin, rope_store_kv_ref, rope_store_kv_triton
from kernels.norm import qk_rms_norm_ref
from kernels.prefill_attention import paged_prefill_attention_triton, prefill_work
from protocol.config import EngineConfig
from tests.test_engine import MAX_NEW, _assert_all_blocks_free, _generate, _hf_greedy, _prompts
from tests.test_kernels_edge import paged_cache
from worker import kv_cache
from worker.startup import build_runner

_TORCH_OF = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}


@pytest.fixture(autouse=True)
def interpreter_rounds_to_e4m3_as_the_gpu(monkeypatch):
    """Triton 3.9's interpreter rounds floats to e4m3 wrongly: ties away from zero, and a carry out of the mantissa
    is lost (31.9 gives 16; triton-lang/triton#8322, fixes open in #9808 and #11897). The GPU's cvt.rn.satfinite
    rounds to nearest even, as torch does: the interpreter's casts to e4m3 go through torch here."""
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def to_e4m3_as_torch(data, src, dst, rounding_mode):
        if dst != tl.float8e4nv or src not in _TORCH_OF:
            return convert(data, src, dst, rounding_mode)
        x = torch.frombuffer(bytearray(data.tobytes()), dtype=_TORCH_OF[src])
        return x.float().to(FP8_KV_DTYPE).view(torch.uint8).numpy().reshape(data.shape)

    monkeypatch.setattr(interpreter, "_convert_float", to_e4m3_as_torch)


def fp8_cache(lens: list[int], hkv: int, d: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random e4m3 caches (values up to ~16, every exponent of the range used) and shuffled block tables."""
    k_cache, v_cache, tables = paged_cache(lens, hkv, d, block_size)
    return (4 * k_cache).to(FP8_KV_DTYPE), (4 * v_cache).to(FP8_KV_DTYPE), tables


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_references_round_once_clamp_to_448_and_read_back_exactly():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.0625001, 31.9, -500.0, 448.0, 1e6, 2.0**-9, -(2.0**-10)])
    stored = to_cache_ref(x, FP8_KV_DTYPE)
    assert stored.dtype == FP8_KV_DTYPE
    # 1.0625 is a tie (to even: 1.0); just above it rounds up; 31.9 carries into the next exponent; clamped to 448.
    assert from_cache_ref(stored).tolist() == [0.0, 1.0, 1.0, 1.125, 32.0, -E4M3_MAX, 448.0, 448.0, 2.0**-9, -0.0]
    assert torch.equal(to_cache_ref(x, torch.bfloat16), x.bfloat16())  # other caches: a plain cast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_triton_writes_the_references_e4m3_bytes(dtype):
    hq, hkv, d, block_size = 4, 2, 64, 16
    qkv = torch.randn(9, (hq + 2 * hkv) * d) * 30
    qkv[:, hq * d :: 7] = 31.9  # rounds up into the next exponent
    qkv[:, hq * d :: 11] = -1000.0  # clamped to -448 (past 448 after RoPE too)
    q, k, v = (t.unflatten(1, (-1, d)).to(dtype) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    positions = torch.randint(0, 100, (9,))
    slots = torch.tensor([0, 5, 17, -1, 18, 40, -1, 33, 3])
    cos_sin = make_cos_sin(128, d, 1e4, "cpu")
    caches = [torch.full((3, hkv, block_size, d), 7.0).to(FP8_KV_DTYPE) for _ in range(4)]
    q_rot = rope_store_kv_triton(q, k, v, positions, cos_sin, caches[0], caches[1], slots)
    q_ref = rope_store_kv_ref(q, k, v, positions, cos_sin, caches[2], caches[3], slots)
    torch.testing.assert_close(q_rot, q_ref, atol=1e-4, rtol=1e-4 if dtype == torch.float32 else 1e-2)
    assert same_bytes(caches[0], caches[2]) and same_bytes(caches[1], caches[3])
    stored = from_cache_ref(caches[1])
    assert (stored == 7.0).all(-1).sum() == 3 * block_size * hkv - 7 * hkv  # the two -1 lanes stored nothing
    assert stored.abs().max() == E4M3_MAX and (stored == 32.0).any()


def decode_step(lens: list[int], hkv: int, group: int, d: int, block_size: int, dtype: torch.dtype):
    """A decode step's inputs on an e4m3 cache: q, its own k and v (strided views of one qkv row) to store at each
    row's last position (slot -1 for an empty row)."""
    k_cache, v_cache, tables = fp8_cache(lens, hkv, d, block_size)
    q, k, v = (
        (torch.randn(len(lens), n * hkv, d) * 8).to(dtype) for n in (group, 1, 1)
    )  # * 8: the new K/V take e4m3's coarser steps
    ctx = torch.tensor(lens, dtype=torch.int32)
    last = (ctx - 1).clamp(min=0).long()
    slots = tables.gather(1, (last // block_size)[:, None].int()).flatten().long() * block_size + last % block_size
    slots[ctx == 0] = -1
    return q, k, v, last, slots, ctx, (k_cache, v_cache, tables)


@pytest.mark.parametrize(
    "lens,hkv,group,dtype,qk_norm",
    [
        ([5, 0, 200, 17], 2, 3, torch.float32, False),  # a few rows: the early-loading launch
        ([0, 1, 63, 64, 65, 130, 7, 9, 20], 1, 7, torch.float32, False),  # nine rows: the many-rows launch
        ([5, 0, 200, 17], 2, 3, torch.float16, True),  # half-precision dots on the widened tiles, Qwen3's q/k norm
        ([0, 1, 63, 64, 65, 130, 7, 9, 20], 2, 2, torch.float16, False),
    ],
)
def test_decode_stores_the_steps_kv_in_e4m3_and_attends_as_the_reference(lens, hkv, group, dtype, qk_norm, monkeypatch):
    monkeypatch.setattr(decode_attention, "_partition_size", lambda *shape: 64)  # several splits, combined
    d, block_size = 64, 16
    q, k, v, positions, slots, ctx, (k_cache, v_cache, tables) = decode_step(lens, hkv, group, d, block_size, dtype)
    cos_sin = make_cos_sin(max(lens) + 1, d, 1e6, "cpu")
    norm = (torch.rand(d).to(dtype) + 0.5, torch.rand(d).to(dtype) + 0.5, 1e-6) if qk_norm else ()
    k_ref, v_ref, v_before, q_in, k_in = k_cache.clone(), v_cache.clone(), v_cache.clone(), q.clone(), k.clone()
    if qk_norm:
        qk_rms_norm_ref(q_in, k_in, *norm)
    q_rot = rope_store_kv_ref(q_in, k_in, v, positions, cos_sin, k_ref, v_ref, slots)
    want = paged_attention_ref(q_rot, k_ref, v_ref, tables, torch.arange(len(lens) + 1), ctx, d**-0.5)
    new_kv = NewTokenKV(k, v, positions, cos_sin, slots, *norm)
    got = rope_store_decode_attention_triton(q, new_kv, k_cache, v_cache, tables, ctx, d**-0.5)
    assert same_bytes(k_cache, k_ref) and same_bytes(v_cache, v_ref)
    assert not same_bytes(v_cache, v_before)  # the step's own V went in
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert all(got[b].abs().max() == 0 for b, n in enumerate(lens) if n == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_attention_reads_an_e4m3_cache_as_the_reference(dtype):
    # Cached prefixes mid-block and past a key tile, a whole prompt, a one-query row, several query blocks.
    lens, qlens, group, hkv, d, block_size = [37, 16, 20, 150], [5, 16, 1, 70], 3, 2, 64, 8
    k_cache, v_cache, tables = fp8_cache(lens, hkv, d, block_size)
    q = torch.randn(sum(qlens), group * hkv, d).to(dtype)
    cu = torch.tensor([0, *np.cumsum(qlens)], dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    work = torch.from_numpy(prefill_work(qlens, group))
    out = paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu, ctx, d**-0.5, work)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, cu, ctx, d**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    # The reference reads e4m3 as the float32 values it holds.
    dense = paged_attention_ref(q, from_cache_ref(k_cache), from_cache_ref(v_cache), tables, cu, ctx, d**-0.5)
    assert torch.equal(ref, dense)


def _sdpa_on_e4m3_kv(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention over K and V rounded to e4m3 as our cache stores them (every token's: the cache returns
    past and present together)."""
    key, value = (from_cache_ref(to_cache_ref(x, FP8_KV_DTYPE)) for x in (key, value))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_greedy_tokens_with_an_fp8_cache_equal_hf_with_k_and_v_rounded_to_e4m3(tiny_ckpt):
    AttentionInterface.register("sdpa_e4m3_kv", _sdpa_on_e4m3_kv)
    AttentionMaskInterface.register("sdpa_e4m3_kv", sdpa_mask)
    prompts = _prompts(512)
    want = _hf_greedy(tiny_ckpt, prompts, MAX_NEW, attn_implementation="sdpa_e4m3_kv")
    assert want != _hf_greedy(tiny_ckpt, prompts, MAX_NEW)  # the rounding changes tokens: the test can tell
    with LLM(str(tiny_ckpt), device="cpu", kv_cache_dtype="fp8") as llm:
        assert _generate(llm, prompts) == want
        _assert_all_blocks_free(llm)


def test_an_fp8_cache_holds_twice_the_blocks_of_a_bfloat16_one_in_the_same_bytes(tiny_ckpt, monkeypatch):
    mc = config_from_dir(tiny_ckpt)
    bf16_block = kv_cache.kv_block_bytes(mc, mc.num_key_value_heads, 16, torch.bfloat16)
    assert kv_cache.kv_block_bytes(mc, mc.num_key_value_heads, 16, FP8_KV_DTYPE) * 2 == bf16_block
    monkeypatch.setattr(kv_cache, "_CPU_KV_CACHE_CAP", 100 * bf16_block)  # the budget: 100 bfloat16 blocks
    caches = {}
    for name in ("auto", "fp8", "fp8_e4m3"):
        config = EngineConfig(str(tiny_ckpt), device="cpu", dtype="bfloat16", kv_cache_dtype=name, max_num_seqs=4)
        runner = build_runner(resolve_config(config))
        caches[name] = (runner.num_kv_blocks, runner.kv_caches[0][0].dtype)
        assert sum(t.nbytes for pair in runner.kv_caches for t in pair) == 100 * bf16_block  # the same bytes
    assert caches == {
        "auto": (100, torch.bfloat16),
        "fp8": (200, FP8_KV_DTYPE),
        "fp8_e4m3": (200, FP8_KV_DTYPE),
    }


def test_a_bad_kv_cache_dtype_is_a_value_error_naming_it_and_the_fix(capsys):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2' is invalid: use 'auto' .* or 'fp8'"):
        EngineConfig("m", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bf16' is invalid"):
        LLM("m", kv_cache_dtype="bf16")  # refused before any process starts
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "m", "--kv-cache-dtype", "int8"])
    assert "argument --kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err
    assert cli.parse_args(["--model", "m", "--kv-cache-dtype", "fp8_e4m3"])[0].kv_cache_dtype == "fp8_e4m3"


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[700], [1, 100, 700, 33, 0, 5, 64, 65, 300]])  # a few rows, many rows
def test_on_the_gpu_decode_and_prefill_store_and_read_e4m3_as_the_references_in_bfloat16(lens):
    # Qwen2.5-1.5B's attention shapes; the real kernels' launches (no forced partition).
    hkv, group, d, block_size = 2, 6, 128, 16
    cpu = decode_step(lens, hkv, group, d, block_size, torch.bfloat16)
    q, k, v, positions, slots, ctx, (k_cache, v_cache, tables) = (
        t.cuda() if isinstance(t, torch.Tensor) else tuple(c.cuda() for c in t) for t in cpu
    )
    cos_sin = make_cos_sin(max(lens) + 1, d, 1e6, "cuda")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_rot = rope_store_kv_ref(q, k, v, positions, cos_sin, k_ref, v_ref, slots)
    cu = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
    want = paged_attention_ref(q_rot, k_ref, v_ref, tables, cu, ctx, d**-0.5)
    new_kv = NewTokenKV(k, v, positions, cos_sin, slots)
    got = rope_store_decode_attention_triton(q, new_kv, k_cache, v_cache, tables, ctx, d**-0.5)
    assert same_bytes(k_cache, k_ref) and same_bytes(v_cache, v_ref)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    work = torch.from_numpy(prefill_work([1] * len(lens), group)).cuda()  # one query a row: the same attention
    prefill = paged_prefill_attention_triton(q_rot, k_cache, v_cache, tables, cu, ctx, d**-0.5, work)
    assert ((prefill.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
