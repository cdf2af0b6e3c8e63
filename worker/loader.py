"""Weights into a model: Hugging Face safetensors (one file or shards), or deterministic random ones. Checkpoint names
map onto parameters; every parameter must be filled and no tensor left over. A float weight of an FP8 linear is
quantized whole before its shard is cut, so a row's scale is the same at every TP size."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kernels.fp8 import FP8, quantize

# Checkpoint module name -> (our packed module, shard id).
_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_UNPACKED = {packed: hf for hf, packed in _PACKED.items()}
_SCALE_LEAF = {"weight_scale_inv": "weight_scale"}  # an FP8 checkpoint's name -> ours (w = value * scale)
_HF_SCALE_LEAF = {ours: hf for hf, ours in _SCALE_LEAF.items()}
# copy_ would turn int8 / float8 values into floats without their scales (e4m3 loads into e4m3 parameters only).
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_weights(model: nn.Module, model_dir: str, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Load every tensor of model_dir's safetensors into model (this rank's shard, the model's dtype)."""
    params = dict(model.named_parameters())
    expected = {(n, s) for n, p in params.items() for s in p.shard_ids}
    files = _checkpoint_files(Path(model_dir))
    loaded = set()
    with tqdm(total=sum(map(len, files.values())), desc="Loading weights", unit="tensor", disable=tp_rank != 0) as bar:
        for file, names in files.items():
            with safe_open(file, framework="pt") as f:
                for name in names:
                    loaded |= _load_tensor(params, expected, model, name, f, file)
                    bar.update()
    missing = sorted(_hf_name(n, s) for n, s in expected - loaded)
    if missing:
        raise ValueError(
            f"checkpoint {model_dir} lacks {len(missing)} tensor(s) the model needs: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )


def _load_tensor(params: dict, expected: set, model: nn.Module, name: str, f, file: str) -> set:
    """Copy one checkpoint tensor into its parameter (shard); return the (param, shard) it filled."""
    if (model.config.tie_word_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
        return set()  # a tied head is the embedding; old checkpoints store a RoPE table we recompute
    target, shard = _our_name(name)
    if (target, shard) not in expected:
        raise ValueError(
            f"unexpected tensor {name!r} in {file}: the {type(model).__name__} model has no such "
            "parameter (is the config.json beside the checkpoint the one that came with it?)"
        )
    param, tensor = params[target], f.get_tensor(name)
    if tensor.dtype not in _FLOAT_DTYPES and not (tensor.dtype == FP8 == param.dtype):
        raise ValueError(
            f"tensor {name!r} in {file} is {str(tensor.dtype).removeprefix('torch.')}: Pico-vLLM loads "
            "float32 / float16 / bfloat16 weights, and e4m3 ones of linears in an FP8 checkpoint (with "
            "quantization_config in its config.json): use the unquantized checkpoint"
        )
    loads = {target: tensor}
    if param.dtype == FP8 and tensor.dtype != FP8:  # quantized at load, per block of the full tensor
        scale_name = target + "_scale"
        loads = dict(zip((target, scale_name), quantize(tensor.to(param.device), params[scale_name].block)))
    try:
        for target_name, loaded in loads.items():
            params[target_name].weight_loader(params[target_name], loaded, shard)
    except ValueError as e:
        raise ValueError(f"tensor {name!r} in {file}: {e}") from None
    return {(target_name, shard) for target_name in loads}


def _checkpoint_files(model_dir: Path) -> dict[str, list[str]]:
    """{file: its tensor names}, from the shard index or from each file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, file in sorted(json.loads(index.read_text())["weight_map"].items()):
            files.setdefault(str(model_dir / file), []).append(name)
        return files
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ValueError(
            f"no *.safetensors in {model_dir}: pass a directory with safetensors weights, "
            "or use --load-format dummy for random weights"
        )
    files = {}
    for path in paths:
        with safe_open(path, framework="pt") as f:
            files[str(path)] = list(f.keys())
    return files


def _our_name(name: str) -> tuple[str, str | int | None]:
    module, _, leaf = name.rpartition(".")
    leaf = _SCALE_LEAF.get(leaf, leaf)
    parent, _, proj = module.rpartition(".")
    if proj in _PACKED:
        packed, shard = _PACKED[proj]
        return f"{parent}.{packed}.{leaf}", shard
    return f"{module}.{leaf}", None


def _hf_name(target: str, shard: str | int | None) -> str:
    module, _, leaf = target.rpartition(".")
    leaf = _HF_SCALE_LEAF.get(leaf, leaf)
    if shard is None:
        return f"{module}.{leaf}"
    parent, _, packed = module.rpartition(".")
    return f"{parent}.{_UNPACKED[(packed, shard)]}.{leaf}"


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights, the same for a seed: linears ~ N(0, 1/fan_in), norms 1, biases small. Unit-variance projections
    of normed inputs keep the residual stream O(sqrt(layers)) and logits O(1), so bf16 activations stay finite and
    varied through every layer of the real model shapes."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name.endswith(".bias"):
            param.normal_(0.0, 0.02, generator=gen)
        elif param.dim() == 1:  # RMSNorm weights
            param.fill_(1.0)
        elif param.dtype == FP8:  # the model dtype's weights (the same draw), then quantized as at load
            w = torch.empty(param.shape, dtype=model.lm_head.weight.dtype, device=param.device)
            scale = params[name + "_scale"]
            values, scales = quantize(w.normal_(0.0, _dummy_std(param), generator=gen), scale.block)
            param.copy_(values)
            scale.copy_(scales)
        elif not hasattr(param, "block"):  # an FP8 scale is set with its weight
            param.normal_(0.0, _dummy_std(param), generator=gen)


def _dummy_std(param: torch.Tensor) -> float:
    # A row-parallel shard holds 1/tp of its input dim: scale by the full one, the same at every TP size.
    return 1.0 / math.sqrt(getattr(param, "full_in", param.shape[1]))
