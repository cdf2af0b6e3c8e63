"""Weight loading: checkpoint names onto packed parameters, TP shards, dtype, and one clear error per fault."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from frontend.model_resolution import resolve_model
from worker.loader import init_dummy_weights, load_weights
from worker.models import Qwen2ForCausalLM


def edited_checkpoint(src: Path, dst: Path, edit) -> str:
    """A copy of the single-file checkpoint src whose tensors dict went through edit(tensors)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return str(dst)


def load(model_dir: str, tp_rank: int = 0, tp_size: int = 1, dtype=torch.float32) -> Qwen2ForCausalLM:
    config, _ = resolve_model(model_dir)
    torch.set_default_dtype(dtype)
    try:
        model = Qwen2ForCausalLM(config, tp_rank, tp_size)
    finally:
        torch.set_default_dtype(torch.float32)
    load_weights(model, model_dir, tp_rank, tp_size)
    return model


def test_missing_tensor_is_named(tiny_ckpt, tmp_path):
    path = edited_checkpoint(tiny_ckpt, tmp_path / "c", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load(path)


def test_mis_shaped_tensor_gives_its_name_and_both_shapes(tiny_ckpt, tmp_path):
    def transpose_k(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"].T.contiguous()

    path = edited_checkpoint(tiny_ckpt, tmp_path / "c", transpose_k)
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(64, 32\).*\(32, 64\)"
        r".*config\.json",
    ):
        load(path)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "float8"])
def test_tensor_of_a_non_float_or_quantized_dtype_is_named_with_the_fix(tiny_ckpt, tmp_path, dtype):
    def quantize(t):  # same shape, so only the dtype can tell that these are not the real values
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].to(dtype)

    path = edited_checkpoint(tiny_ckpt, tmp_path / "c", quantize)
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.down_proj\.weight.*" + str(dtype).removeprefix("torch.") + r".*unquantized",
    ):
        load(path)


def test_unexpected_tensor_is_named(tiny_ckpt, tmp_path):
    def add_extra(t):
        t["model.layers.0.self_attn.rel_bias.weight"] = torch.zeros(4)

    path = edited_checkpoint(tiny_ckpt, tmp_path / "c", add_extra)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.rel_bias\.weight'"):
        load(path)


def test_untied_model_needs_its_lm_head(tmp_path):
    from checkpoints import make_checkpoint

    path = edited_checkpoint(
        make_checkpoint(tmp_path / "src", tie=False), tmp_path / "c", lambda t: t.pop("lm_head.weight")
    )
    with pytest.raises(ValueError, match="lm_head.weight"):
        load(path)


def test_directory_without_safetensors_says_how_to_get_weights(tiny_ckpt, tmp_path):
    shutil.copytree(tiny_ckpt, tmp_path / "c", ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="no \\*.safetensors.*--load-format dummy"):
        load(str(tmp_path / "c"))


def test_weights_convert_to_the_model_dtype_and_tied_head_is_the_embedding(tiny_ckpt):
    model = load(str(tiny_ckpt), dtype=torch.bfloat16)
    ref = load_file(tiny_ckpt / "model.safetensors")
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(
        model.model.layers[1].mlp.down_proj.weight, ref["model.layers.1.mlp.down_proj.weight"].bfloat16()
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)], ids=["kv-split", "kv-replicated"])
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_of_two_holds_its_slices(tmp_path, heads, kv_heads, rank):
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path, num_heads=heads, num_kv_heads=kv_heads, head_dim=16, tie=False)
    ref, m = load_file(path / "model.safetensors"), load(str(path), rank, 2)
    attn, mlp, p = m.model.layers[0].self_attn, m.model.layers[0].mlp, "model.layers.0."
    q_rows = slice(rank * heads // 2 * 16, (rank + 1) * heads // 2 * 16)
    kv_head = rank * kv_heads // 2  # a replicated head is the same one on both ranks
    kv_rows = slice(kv_head * 16, (kv_head + max(1, kv_heads // 2)) * 16)
    for part in ("weight", "bias"):
        want = [
            ref[f"{p}self_attn.{x}_proj.{part}"][rows] for x, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
        ]
        assert torch.equal(getattr(attn.qkv_proj, part), torch.cat(want))
    half = slice(rank * 64, (rank + 1) * 64)  # intermediate 128 over 2 ranks
    assert torch.equal(
        mlp.gate_up_proj.weight, torch.cat([ref[p + "mlp.gate_proj.weight"][half], ref[p + "mlp.up_proj.weight"][half]])
    )
    assert torch.equal(mlp.down_proj.weight, ref[p + "mlp.down_proj.weight"][:, half])
    assert torch.equal(attn.o_proj.weight, ref[p + "self_attn.o_proj.weight"][:, q_rows])
    vocab = slice(rank * 256, (rank + 1) * 256)
    assert torch.equal(m.model.embed_tokens.weight, ref["model.embed_tokens.weight"][vocab])
    assert torch.equal(m.lm_head.weight, ref["lm_head.weight"][vocab])


def test_vocab_shards_pad_an_uneven_vocab_with_zero_rows(tmp_path):
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path, vocab_size=510)
    ref, last = load_file(path / "model.safetensors")["model.embed_tokens.weight"], load(str(path), 3, 4)
    rows = last.model.embed_tokens.weight  # ceil(510 / 4) = 128 rows per rank; rank 3 has 126 real ones
    assert rows.shape[0] == 128 and torch.equal(rows[:126], ref[384:]) and not rows[126:].any()


def test_dummy_weights_depend_only_on_the_seed(tiny_ckpt):
    config, _ = resolve_model(str(tiny_ckpt))
    a, b, c = (Qwen2ForCausalLM(config) for _ in range(3))
    for model, seed in ((a, 1), (b, 1), (c, 2)):
        init_dummy_weights(model, seed)
    sa, sb, sc = (m.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["model.layers.0.self_attn.qkv_proj.weight"], sc["model.layers.0.self_attn.qkv_proj.weight"]
    )
    assert torch.equal(sa["model.norm.weight"], torch.ones(config.hidden_size))
