"""Tiny random checkpoints of each family we run (Qwen2, Qwen3, Llama 3), written the way Hugging Face writes
real ones (tests only). `python -m tests.checkpoints DIR` writes the tests' default one, for a first run on a CPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}
# Llama 3.1's scaling, its original context cut to 64 so that positions of a test reach every RoPE band.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Pico-vLLM serves language models fast. def main(): return 42",
    "Numbers 0123456789 and punctuation: ,.;:!? ()[]{}",
    "Paged attention stores keys and values in fixed-size blocks.",
]


def make_tokenizer(out_dir: Path, vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE small enough to train in a second; specials as Qwen names them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def make_checkpoint(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    tie: bool = True,
    sharded: bool = False,
    seed: int = 0,
    max_position_embeddings: int = 4096,
    family: str = "qwen2",
    tokenizer=None,
) -> Path:
    """Write a random float32 model of the family (qwen2, qwen3, llama: with LLAMA3_SCALING) with its tokenizer (a
    tiny trained BPE, or the one given, e.g. an offline Qwen3's: vocab_size must hold it); return the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = make_tokenizer(out)
    else:
        tokenizer.save_pretrained(out)
    config_cls, model_cls = FAMILIES[family]
    scaling = {"rope_scaling": dict(LLAMA3_SCALING)} if family == "llama" else {}
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        torch_dtype="float32",
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        **scaling,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():  # HF's init is tiny (std 0.02); larger weights make logits differ per token
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 0.05)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # per-head norms: near 1, unlike each other
                p.normal_(1.0, 0.2)
    model.save_pretrained(out, max_shard_size="100KB" if sharded else "10GB", safe_serialization=True)
    if sharded:
        assert (out / "model.safetensors.index.json").exists(), "expected a sharded checkpoint"
    return out


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def quantize_fp8_reference(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales, the dequantized float32 weight) of w: each block of rows x cols by its amax /
    448 (Qwen's FP8 and our per-channel quantization, block 1 x K); a loop, independent of kernels/fp8.py."""
    n, k = w.shape
    values, deq = torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(n, k)
    scales = torch.empty(-(-n // rows), -(-k // cols))
    for i in range(0, n, rows):
        for j in range(0, k, cols):
            block = w[i : i + rows, j : j + cols].float()
            scale = block.abs().max().clamp(min=1e-12) / 448.0
            values[i : i + rows, j : j + cols] = (block / scale).to(torch.float8_e4m3fn)
            deq[i : i + rows, j : j + cols] = values[i : i + rows, j : j + cols].float() * scale
            scales[i // rows, j // cols] = scale
    return values, scales, deq


def fp8_checkpoints(src: Path, out_dir: Path, block: list[int] | None = None) -> tuple[Path, Path | None]:
    """(a float twin of src whose linear weights are FP8-quantized then dequantized, an FP8 checkpoint of the
    same values in Qwen's format: e4m3 weights, weight_scale_inv, quantization_config); block None: per output
    channel, and no FP8 checkpoint (per-channel FP8 is quantized at load)."""
    from safetensors.torch import load_file, save_file

    twin, fp8 = Path(out_dir) / "twin", Path(out_dir) / "fp8"
    tensors = {}
    for file in Path(src).glob("*.safetensors"):
        tensors.update(load_file(file))
    deq, quantized = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            rows, cols = block or (1, w.shape[1])
            values, scales, deq[name] = quantize_fp8_reference(w, rows, cols)
            quantized[name], quantized[name + "_scale_inv"] = values, scales
    for out, weights in [(twin, deq)] + [(fp8, quantized)] * bool(block):
        out.mkdir(parents=True)
        for file in Path(src).iterdir():
            if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
                (out / file.name).write_bytes(file.read_bytes())
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    if not block:
        return twin, None
    config = read_config(fp8)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
    }
    (fp8 / "config.json").write_text(json.dumps(config))
    return twin, fp8


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tests.checkpoints",
        description="Write the tests' tiny random checkpoint (2 layers, hidden size 64, its own tokenizer) into DIR.",
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--family", choices=FAMILIES, default="qwen2", help="qwen2 (Qwen2.5's architecture), qwen3, llama")
    args = p.parse_args(argv)
    out = make_checkpoint(args.dir, family=args.family)
    print(f"wrote {out}; try: python launch.py --model {out} --device cpu --prompt Hello --max-tokens 16")


if __name__ == "__main__":
    main()
