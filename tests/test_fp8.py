"""FP8 weights (--quantization fp8, and FP8 checkpoints in Qwen's format): the quantization, the Triton GEMV on e4m3
weights (every kernel path and fold, CPU: Triton's interpreter) and whole models equal to Hugging Face run on the
same weights quantized and multiplied back."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import fp8_checkpoints, make_checkpoint, quantize_fp8_reference
from test_gemv import FOLD_CONFIGS, FOLD_IDS
from test_model import PagedRun, build_model, dummy_bf16_cuda_model, hf_logits, hf_model, tokens_for

from frontend.model_resolution import resolve_model
from kernels import gemv
from kernels.fp8 import FP8, PER_CHANNEL, Fp8Weight, quantize, quantize_rows
from kernels.gemv import GemvConfig, NormedInput
from worker.linear import run_path
from worker.loader import init_dummy_weights, load_weights
from worker.models import model_class

TINY_BLOCK = [16, 32]  # Qwen's is [128, 128]; a tiny model's shards and q/k/v offsets are multiples of 16
FAMILIES = {
    "qwen2-tied": dict(family="qwen2"),
    "qwen3-untied": dict(family="qwen3", tie=False, head_dim=32),
    "llama-sharded": dict(family="llama", sharded=True),
}


@pytest.mark.parametrize("shape,block", [((45, 100), PER_CHANNEL), ((45, 100), (16, 32)), ((128, 256), (128, 128))])
def test_quantize_is_each_blocks_amax_over_448_in_e4m3(shape, block):
    w = torch.randn(*shape) * torch.rand(shape[0], 1) * 10  # rows of unlike ranges
    w[3] = 0.0  # an all-zero row (block) gets a tiny scale, not a NaN
    values, scales = quantize(w, block)
    ref_values, ref_scales, deq = quantize_fp8_reference(w, block[0], block[1] or shape[1])
    assert values.dtype == FP8 and scales.dtype == torch.float32 and scales.shape == ref_scales.shape
    assert torch.equal(values.float(), ref_values.float()) and torch.equal(scales, ref_scales)
    assert torch.equal(Fp8Weight(values, scales, block).dequantize(torch.float32), deq)
    assert (deq - w).abs().max() <= w.abs().max() / 16  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_quantize_rows_kernel_is_each_rows_amax_over_448(device):
    x = torch.randn(5, 2500, device=device) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0], device=device)[:, None]
    values, scales = quantize_rows(x[:, 3:2003])  # a strided view
    ref_values, ref_scales, _ = quantize_fp8_reference(x[:, 3:2003].cpu(), 1, 2000)
    assert torch.equal(scales.cpu(), ref_scales)
    if device == "cuda":  # Triton's interpreter rounds to e4m3 wrongly next to a power of two (124.8 -> 64)
        assert torch.equal(values.cpu().float(), ref_values.float())


def _fold_input(fold: str, m: int, k: int) -> torch.Tensor | NormedInput:
    x = 3 * torch.randn(m, k)
    return NormedInput.of(x, torch.randn(m, k), 1 + torch.rand(k), 1e-6)[0] if fold.startswith("norm") else x


@pytest.mark.parametrize("config", FOLD_CONFIGS, ids=FOLD_IDS)
@pytest.mark.parametrize("block", [PER_CHANNEL, (8, 32)], ids=["per-channel", "blocks-8x32"])
@pytest.mark.parametrize("fold", ["", "norm", "swiglu", "norm+swiglu"])
def test_fp8_gemv_equals_the_linear_on_its_dequantized_weight(config, block, fold):
    if block[1] % config.block_k or (fold.endswith("swiglu") and config.split_k > 1):
        pytest.skip("a K tile across scale blocks, or SwiGLU over split K: refused (below)")
    n, k = 80, 100  # gate | up of 40 rows each; neither a multiple of the tiles, K not of the 32-column blocks
    weight = Fp8Weight(*quantize(torch.randn(n, k) / k**0.5, block), block)
    bias = None if fold.endswith("swiglu") else torch.randn(n) / 4
    for m in [1] if config.one_row else [1, 3]:
        torch.manual_seed(m)
        x = _fold_input(fold, m, k)
        out = run_path(fold, x, weight, bias, config)  # the GEMV reading e4m3
        ref = run_path(fold, x, weight, bias, None)  # the unfused path: F.linear on value * scale in float32
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ahead", [2, 3])
@pytest.mark.parametrize("block_k", [32, 128], ids=["k-tiles", "whole-k"])
def test_fp8_one_row_gemv_walking_tiles_ahead_equals_the_dequantized_weight(block_k, ahead, monkeypatch):
    # e4m3 read as int32 words of four values and unpacked in column order; 3 programs walk 10 blocks of 4 rows
    # (one "SM"), loading 2 or 3 tiles ahead. A byte out of order, or a scale dropped or applied twice, fails.
    monkeypatch.setattr(gemv, "num_sms", lambda device: 1)
    config = GemvConfig(4, block_k, one_row=True, per_sm=3, ahead=ahead)
    weight = Fp8Weight(*quantize(torch.randn(80, 100) * torch.rand(80, 1) / 10, PER_CHANNEL), PER_CHANNEL)
    for fold in ("norm", "norm+swiglu"):
        x = _fold_input(fold, 1, 100)
        torch.testing.assert_close(
            run_path(fold, x, weight, None, config), run_path(fold, x, weight, None, None), atol=1e-4, rtol=1e-4
        )
    with pytest.raises(ValueError, match=r"K 98 \(stride \(100, 1\)\) and the address must be multiples of 4"):
        run_path("", torch.randn(1, 98), Fp8Weight(weight.weight[:, :98], weight.scale, PER_CHANNEL), None, config)


def test_a_gemv_tile_across_fp8_scale_blocks_is_refused():
    weight = Fp8Weight(*quantize(torch.randn(32, 64), (16, 32)), (16, 32))
    with pytest.raises(ValueError, match=r"does not fit FP8 scale blocks of \(16, 32\)"):
        run_path("", torch.randn(1, 64), weight, None, GemvConfig(16, 64))


def _quantized_model(path, tp_rank: int = 0, tp_size: int = 1):
    """Our model of a float checkpoint with quantization='fp8' (linears e4m3, per output channel)."""
    config, local = resolve_model(str(path))
    config.quantization = "fp8"
    model = model_class(config.architecture)(config, tp_rank, tp_size)
    load_weights(model, local, tp_rank, tp_size)
    return model.eval()


def _assert_equal_logits(ours, hf, block_size: int = 4) -> None:
    """Prefill then token-by-token decode logits of ours equal HF's."""
    prompt = tokens_for(3, 3 * block_size + 2)
    run = PagedRun(ours, block_size)
    got = run.step({0: prompt[:5]}) + [run.step({0: [t]})[0] for t in prompt[5:]]
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_quantization_fp8_equals_hf_on_weights_quantized_per_channel(name, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", **FAMILIES[name])
    twin, _ = fp8_checkpoints(ckpt, tmp_path)
    ours = _quantized_model(ckpt)
    qkv, head = ours.model.layers[0].self_attn.qkv_proj, ours.lm_head
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (qkv.weight.shape[0], 1)
    assert head.weight.dtype == torch.float32 and ours.model.embed_tokens.weight.dtype == torch.float32
    _assert_equal_logits(ours, hf_model(twin))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_block_fp8_checkpoint_runs_e4m3_and_equals_hf_on_its_dequantized_twin(name, tmp_path):
    twin, fp8 = fp8_checkpoints(make_checkpoint(tmp_path / "ckpt", **FAMILIES[name]), tmp_path, TINY_BLOCK)
    ours = build_model(fp8)  # the quantization comes from config.json
    gate_up = ours.model.layers[1].mlp.gate_up_proj
    assert gate_up.weight.dtype == FP8 and gate_up.weight_scale.shape == (2 * 128 // 16, 64 // 32)
    _assert_equal_logits(ours, hf_model(twin))


def test_block_scales_across_a_tensor_parallel_shard_are_a_clear_error(tmp_path):
    # 2 KV heads of 16 over 2 ranks: rank 1's k rows start at row 16, inside a 32-row scale block.
    _, fp8 = fp8_checkpoints(make_checkpoint(tmp_path / "ckpt"), tmp_path, [32, 32])
    with pytest.raises(ValueError, match=r"k_proj\.weight_scale_inv.*starts at 16.*multiples of 32"):
        build_model(fp8, tp_rank=1, tp_size=2)


@pytest.mark.parametrize(
    "edit,match",
    [
        (dict(quant_method="gptq"), "quant_method='gptq' is not supported"),
        (dict(fmt="e5m2"), "fmt='e5m2'.*is not supported"),
        (dict(activation_scheme="static"), "activation_scheme='static'.*dynamic activations"),
        (dict(weight_block_size=None), "weight_block_size=None.*weight_block_size \\[rows, columns\\]"),
        (dict(weight_block_size=[128, 100]), "weight_block_size=\\[128, 100\\].*power of two"),
    ],
)
def test_an_fp8_checkpoint_of_another_scheme_is_refused_by_name(tiny_ckpt, tmp_path, edit, match):
    _, fp8 = fp8_checkpoints(tiny_ckpt, tmp_path, TINY_BLOCK)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"].update(edit)
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        resolve_model(str(fp8))


def test_llm_quantization_fp8_greedy_equals_hf_on_the_quantized_twin(tiny_ckpt, tmp_path):
    from test_engine import _hf_greedy, _prompts

    from frontend import LLM, SamplingParams

    twin, _ = fp8_checkpoints(tiny_ckpt, tmp_path)
    prompts = _prompts(512)[:4]
    with LLM(str(tiny_ckpt), device="cpu", quantization="fp8") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(twin, prompts, 12)


def test_dummy_fp8_weights_are_the_model_dtype_draw_quantized(tiny_ckpt):
    config, _ = resolve_model(str(tiny_ckpt))
    plain = model_class(config.architecture)(config)
    init_dummy_weights(plain, seed=3)
    config.quantization = "fp8"
    fp8 = model_class(config.architecture)(config)
    init_dummy_weights(fp8, seed=3)
    for ours, theirs in (
        (fp8.model.layers[1].mlp.down_proj, plain.model.layers[1].mlp.down_proj),
        (fp8.model.layers[0].self_attn.qkv_proj, plain.model.layers[0].self_attn.qkv_proj),
    ):
        values, scales = quantize(theirs.weight, PER_CHANNEL)
        assert torch.equal(ours.weight.float(), values.float()) and torch.equal(ours.weight_scale, scales)
    assert torch.equal(fp8.lm_head.weight, plain.lm_head.weight)


# -- GPU (bench/gpu_tests.py) -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("block", [PER_CHANNEL, (128, 128)], ids=["per-channel", "blocks-128"])
@pytest.mark.parametrize("rows", [1, 4, 16, 64, 256])
def test_fp8_linears_on_cuda_match_the_dequantized_weight_at_qwen_shapes(block, rows, monkeypatch):
    from test_gemv import QWEN_1_5B

    from kernels.gemv import candidate_configs, num_sms
    from worker import linear

    for name, (n, k, has_bias) in QWEN_1_5B.items():
        if name == "lm_head":
            continue
        weight = Fp8Weight(*quantize(torch.randn(n, k, device="cuda") / k**0.5, block), block)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(
            x.float(), weight.dequantize(torch.float32), bias.float() if has_bias else None
        )
        configs = candidate_configs(n, k, num_sms(x.device), rows, fp8_block=block) if rows <= 16 else []
        outs = {str(c): run_path("", x, weight, bias, c) for c in configs}  # the GEMV reading e4m3
        for path in [*linear.SCALED_MM, "dequant"]:
            monkeypatch.setattr(linear, "FP8_GEMM", path)
            outs[path] = run_path("", x, weight, bias, None)
        for what, out in outs.items():
            # scaled_mm rounds x to e4m3 (~3% of an output's scale); the weight-only paths round to bf16 only
            tol = 0.06 if what in linear.SCALED_MM else 0.02
            err = (out.float() - ref).abs().max() / ref.abs().max()
            assert err < tol, f"{name} rows {rows} {what}: relative error {err:.4f}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "qwen3-1.7b"])
def test_fp8_and_bf16_logits_of_dummy_weights_agree_on_cuda(name, capsys):
    """FP8 against bf16 on the same dummy draw: cosine of the logits and top-1 agreement (printed with -s)."""
    config, _ = resolve_model(name, load_format="dummy")
    logits = {}
    for quantization in (None, "fp8"):
        config.quantization = quantization
        run = PagedRun(dummy_bf16_cuda_model(config), 16, num_blocks=64)
        prompt = tokens_for(15, 100, config.vocab_size)
        steps = run.step({0: prompt})[0]
        logits[quantization] = torch.cat([steps] + [run.step({0: [t]})[0] for t in prompt[:60]]).float()
        del run
    bf16, fp8 = logits[None], logits["fp8"]
    cosine = torch.nn.functional.cosine_similarity(bf16, fp8, dim=-1)
    top1 = (bf16.argmax(-1) == fp8.argmax(-1)).float().mean().item()
    with capsys.disabled():
        print(
            f"\n{name} FP8 vs bf16 logits over {len(bf16)} positions: cosine mean {cosine.mean():.4f} min "
            f"{cosine.min():.4f}, top-1 agreement {top1:.3f}"
        )
    # Random weights' logits have close runners-up, so FP8's noise flips some top-1s; a wrong scale flips all.
    assert cosine.min() > 0.9 and top1 > 0.25, f"cosine min {cosine.min():.4f}, top-1 {top1:.3f}"
