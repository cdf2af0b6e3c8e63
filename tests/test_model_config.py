"""--model resolution: short names, local directories, the HF cache, and one clear error when nothing fits."""

from __future__ import annotations

import json
import shutil

import pytest
from huggingface_hub import constants

from frontend.model_resolution import resolve_model
from protocol.config import check_tp_size

# hidden, intermediate, layers, heads, kv heads, tied, vocab
PUBLISHED = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, True, 151936),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, True, 151936),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, True, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, False, 152064),
}


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch):
    """An HF cache of our own (a machine's real one may hold Qwen models), offline."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_short_names_with_dummy_weights_need_no_files(name, empty_hf_cache):
    for suffix, eos in (("", [151645, 151643]), ("-base", [151643])):
        config, path = resolve_model(name + suffix, load_format="dummy")
        got = (
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.tie_word_embeddings,
            config.vocab_size,
        )
        assert path is None and got == PUBLISHED[name] and config.eos_token_ids == eos
        assert (config.head_dim, config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (
            128,
            1e6,
            1e-6,
            32768,
        )


def test_local_directory_gives_its_config_and_generation_eos(tiny_ckpt):
    config, path = resolve_model(str(tiny_ckpt))
    assert path == str(tiny_ckpt)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        64,
        4,
        2,
        16,
    )
    assert config.rope_theta == 10000.0 and config.torch_dtype == "float32" and config.tie_word_embeddings
    assert config.eos_token_ids == [2]


def test_head_dim_defaults_to_hidden_over_heads_and_eos_list_comes_from_config(tiny_ckpt, tmp_path):
    model_dir = edit_config(tiny_ckpt, tmp_path, head_dim=None, eos_token_id=[2, 0])
    (model_dir / "generation_config.json").unlink()
    config, _ = resolve_model(str(model_dir))
    assert config.head_dim == 64 // 4 and config.eos_token_ids == [2, 0]


def test_unsupported_architecture_is_named_with_the_supported_ones(tiny_ckpt, tmp_path):
    model_dir = edit_config(tiny_ckpt, tmp_path, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match="MistralForCausalLM.*Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM"):
        resolve_model(str(model_dir))


@pytest.mark.parametrize(
    "edit,match",
    [
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope scaling 'yarn'"),
        (dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True), "attention_bias"),
    ],
)
def test_rope_scaling_and_biases_we_do_not_run_are_refused(tiny_ckpt, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        resolve_model(str(edit_config(tiny_ckpt, tmp_path, **edit)))


# hidden, intermediate, layers, heads, kv heads, head_dim, tied, max positions, RoPE theta, llama3 factor:
# config.json of the repos; Qwen3's base repos have 32,768 positions, the post-trained ones 40,960.
PUBLISHED_NEW = {
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", (1024, 3072, 28, 16, 8, 128, True, 40960, 1e6, None)),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B", (2048, 6144, 28, 16, 8, 128, True, 40960, 1e6, None)),
    "qwen3-4b": ("Qwen/Qwen3-4B", (2560, 9728, 36, 32, 8, 128, True, 40960, 1e6, None)),
    "qwen3-8b": ("Qwen/Qwen3-8B", (4096, 12288, 36, 32, 8, 128, False, 40960, 1e6, None)),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B-Instruct", (2048, 8192, 16, 32, 8, 64, True, 131072, 5e5, 32.0)),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B-Instruct", (3072, 8192, 28, 24, 8, 128, True, 131072, 5e5, 32.0)),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", (4096, 14336, 32, 32, 8, 128, False, 131072, 5e5, 8.0)),
}


@pytest.mark.parametrize("name", list(PUBLISHED_NEW))
def test_qwen3_and_llama_short_names_carry_the_published_configs(name, empty_hf_cache):
    from frontend.model_resolution import short_model

    repo, shape = PUBLISHED_NEW[name]
    config, path = resolve_model(name, load_format="dummy")
    scaling = config.rope_scaling
    got = (
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.tie_word_embeddings,
        config.max_position_embeddings,
        config.rope_theta,
        scaling and scaling["factor"],
    )
    assert path is None and got == shape and short_model(name)[0] == repo
    llama = name.startswith("llama")
    assert config.architecture == ("LlamaForCausalLM" if llama else "Qwen3ForCausalLM")
    assert config.vocab_size == (128256 if llama else 151936)
    assert config.eos_token_ids == ([128001, 128008, 128009] if llama else [151645, 151643])
    base_repo, base = short_model(name + "-base")
    assert base_repo == repo.removesuffix("-Instruct") + ("" if llama else "-Base")
    assert base.eos_token_ids == ([128001] if llama else [151643])
    assert base.max_position_embeddings == (131072 if llama else 32768)
    if llama:
        assert scaling == {
            "rope_type": "llama3",
            "factor": shape[-1],
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }


def test_quantized_checkpoint_is_refused_with_its_method_and_the_fix(tiny_ckpt, tmp_path):
    model_dir = edit_config(tiny_ckpt, tmp_path, quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method='awq' is not supported.*FP8 checkpoints.*quantization='fp8'"):
        resolve_model(str(model_dir))


def test_unknown_repo_offline_fails_once_with_the_three_ways_out(empty_hf_cache):
    with pytest.raises(ValueError) as err:
        resolve_model("pico-vllm-tests/no-such-model")
    msg = str(err.value)
    assert "'pico-vllm-tests/no-such-model'" in msg and "not in the Hugging Face cache" in msg
    assert "HF_HUB_OFFLINE is set" in msg
    assert "local path" in msg and "go online" in msg and "load_format='dummy'" in msg  # LLM's name, not the flag


def test_short_name_with_real_weights_needs_files(empty_hf_cache):
    with pytest.raises(ValueError, match="Qwen/Qwen2.5-0.5B-Instruct.*load_format='dummy'"):
        resolve_model("qwen2.5-0.5b")


def test_repo_id_is_found_in_the_hf_cache(tiny_ckpt, empty_hf_cache):
    snapshot = empty_hf_cache / "models--acme--tiny-qwen" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_ckpt, snapshot)
    (empty_hf_cache / "models--acme--tiny-qwen" / "refs").mkdir()
    (empty_hf_cache / "models--acme--tiny-qwen" / "refs" / "main").write_text("a" * 40)
    config, path = resolve_model("acme/tiny-qwen")
    assert path == str(snapshot) and config.num_key_value_heads == 2


def test_tp_size_must_divide_query_heads_and_fit_kv_heads():
    config, _ = resolve_model("qwen2.5-1.5b", load_format="dummy")  # 12 query heads, 2 KV heads
    check_tp_size(config, 4)  # KV heads replicated: 2 ranks per KV head
    with pytest.raises(ValueError, match="tensor_parallel_size=5.*12 query heads"):
        check_tp_size(config, 5)
    config.num_key_value_heads = 3
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*3 KV heads"):
        check_tp_size(config, 2)
    config.intermediate_size = 8962
    with pytest.raises(ValueError, match="tensor_parallel_size=4.*intermediate size 8962"):
        check_tp_size(config, 4)


def edit_config(src, tmp_path, **changes):
    """A copy of checkpoint src with config.json keys changed (None removes a key)."""
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        cfg.pop(key) if value is None else cfg.__setitem__(key, value)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
