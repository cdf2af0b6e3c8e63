"""The Hugging Face baseline: the same model shape through transformers' `generate`, in the bench's process.

Run it after our engine has shut down, so that the two never share the GPU's memory.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import device_name, dtype_name
from protocol.config import ModelConfig


def hf_config(config: ModelConfig):
    """transformers' config of the same architecture (Qwen2Config, Qwen3Config or LlamaConfig)."""
    import transformers

    scaling = {"rope_scaling": dict(config.rope_scaling)} if config.rope_scaling else {}
    return getattr(transformers, config.architecture.replace("ForCausalLM", "Config"))(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        **scaling,
    )


def load_hf_model(args: argparse.Namespace, config: ModelConfig, model_path: str | None):
    """Our model's twin: from_pretrained of the directory, or (dummy weights) random from the same config."""
    import transformers

    model_class = getattr(transformers, config.architecture)
    dtype = getattr(torch, dtype_name(args, config))
    device = device_name(args)
    if model_path is not None and args.load_format != "dummy":
        return model_class.from_pretrained(model_path, dtype=dtype).to(device).eval()
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype on the device: no float32 copy first
    try:
        with torch.device(device):
            model = model_class(hf_config(config))
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def hf_generate(model, prompts: list[list[int]], max_new: int, temperature: float = 0.0) -> int:
    """Exactly max_new tokens for each prompt of a left-padded batch; returns the padded prompt width."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=0,
            **sampling,
        )
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    if out.shape[1] != width + max_new:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, not {max_new}")
    return width
