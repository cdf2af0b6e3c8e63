"""An EngineConfig resolved once, here: model dir, ModelConfig, max_model_len; children resolve nothing."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

from protocol.config import ARCHITECTURES, EngineConfig, InvalidParam, ModelConfig, check_tp_size


class _Shape(NamedTuple):
    """The ModelConfig fields in which the published sizes of a family differ."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    head_dim: int = 128


_QWEN25_SIZES = {
    "0.5b": _Shape(896, 4864, 24, 14, 2, True),
    "1.5b": _Shape(1536, 8960, 28, 12, 2, True),
    "3b": _Shape(2048, 11008, 36, 16, 2, True),
    "7b": _Shape(3584, 18944, 28, 28, 4, False),
}
_QWEN3_SIZES = {
    "0.6b": _Shape(1024, 3072, 28, 16, 8, True),
    "1.7b": _Shape(2048, 6144, 28, 16, 8, True),
    "4b": _Shape(2560, 9728, 36, 32, 8, True),
    "8b": _Shape(4096, 12288, 36, 32, 8, False),
}
_LLAMA_SIZES = {
    "3.2-1b": _Shape(2048, 8192, 16, 32, 8, True, head_dim=64),
    "3.2-3b": _Shape(3072, 8192, 28, 24, 8, True),
    "3.1-8b": _Shape(4096, 14336, 32, 32, 8, False),
}
_FAMILIES = {  # short-name prefix: (the family as --help names it, its published sizes)
    "qwen2.5-": ("Qwen2.5", _QWEN25_SIZES),
    "qwen3-": ("Qwen3", _QWEN3_SIZES),
    "llama-": ("Llama 3.x", _LLAMA_SIZES),
}
_NO_WEIGHTS = ["*.json", "*.txt", "*.jinja", "*.tiktoken", "*.model"]  # what dummy weights still need


def resolve_config(config: EngineConfig) -> EngineConfig:
    """Resolve the model name once, here, so that child processes start from files and numbers."""
    model_config, model_path = resolve_model(config.model, config.load_format)
    check_tp_size(model_config, config.tensor_parallel_size)
    if model_config.quantization:  # an FP8 checkpoint runs as FP8
        config.quantization = model_config.quantization
    model_config.quantization = config.quantization
    if config.device == "cuda":
        _check_gpus(len(config.local_ranks))
    if config.trace_dir is not None:
        _check_writable_dir(config.trace_dir)
    config.model_config, config.model_path = model_config, model_path
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        config.max_model_len = limit
    elif config.max_model_len > limit:
        raise InvalidParam(
            "max_model_len",
            f"max_model_len={config.max_model_len} is over the model's "
            f"max_position_embeddings={limit}: use at most {limit}",
        )
    return config


def _check_gpus(needed: int) -> None:
    """Refuse device='cuda' before any process starts when torch sees too few GPUs."""
    import torch  # lazy: only device='cuda' needs it; device_count asks NVML and leaves CUDA uninitialised here

    count = torch.cuda.device_count()
    if count == 0:
        why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU is visible"
        raise InvalidParam(
            "device",
            f"device='cuda' but torch sees no CUDA GPU ({why}): use device='cpu' or 'auto', or a machine with a GPU",
        )
    if count < needed:
        raise InvalidParam(
            "tensor_parallel_size",
            f"tensor_parallel_size={needed} needs {needed} GPUs but torch sees {count}: use at most {count}",
        )


def _check_writable_dir(path: str) -> None:
    """Fail at launch, not after the whole run, when the trace cannot be written at shutdown."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise InvalidParam(
            "trace_dir", f"trace_dir={path!r} cannot be written ({e}): pass a writable directory"
        ) from None


def short_model(name: str) -> tuple[str, ModelConfig] | None:
    """The HF repo id and built-in config of a short name like 'qwen3-1.7b[-base]', else None."""
    key = name.lower()
    base, key = key.endswith("-base"), key.removesuffix("-base")
    for family, (_, sizes) in _FAMILIES.items():
        size = key.removeprefix(family)
        if key.startswith(family) and size in sizes:
            return _short_config(family, size, sizes[size], base)
    return None


def families() -> dict[str, list[str]]:
    """Each family we run, as --help names it, and its short names."""
    return {name: [prefix + size for size in sizes] for prefix, (name, sizes) in _FAMILIES.items()}


def short_names() -> list[str]:
    return [short for names in families().values() for short in names]


def _short_config(family: str, size: str, shape: _Shape, base: bool) -> tuple[str, ModelConfig]:
    if family == "llama-":
        repo = f"meta-llama/Llama-{size.upper()}" + ("" if base else "-Instruct")
        return repo, ModelConfig(
            **shape._asdict(),
            vocab_size=128256,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            # <|end_of_text|>; instruct models also end on <|eom_id|> and <|eot_id|>
            eos_token_ids=[128001] if base else [128001, 128008, 128009],
            architecture="LlamaForCausalLM",
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0 if size.startswith("3.1") else 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    qwen3 = family == "qwen3-"
    if qwen3:
        repo = f"Qwen/Qwen3-{size.upper()}" + ("-Base" if base else "")
    else:
        repo = f"Qwen/Qwen2.5-{size.upper()}" + ("" if base else "-Instruct")
    return repo, ModelConfig(
        **shape._asdict(),
        vocab_size=152064 if size == "7b" else 151936,
        eos_token_ids=[151643] if base else [151645, 151643],  # <|endoftext|>; instruct: <|im_end|> first
        max_position_embeddings=40960 if qwen3 and not base else 32768,
        architecture="Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM",
    )


def resolve_model(name: str, load_format: str = "auto") -> tuple[ModelConfig, str | None]:
    """Resolve --model: a local dir, an HF repo id (cache, then hub when online) or a short name (qwen3-1.7b). The
    directory is None only for load_format="dummy" with a short name and no files anywhere."""
    path = Path(name).expanduser()
    if path.is_dir():
        return config_from_dir(path), str(path)
    if name.startswith(("/", ".", "~")):  # a path, not a repo id: the hub cannot help
        raise InvalidParam(
            "model",
            f"model={name!r} is not a directory: pass a Hugging Face-format model "
            "directory, a Hugging Face repo id or a short name such as qwen2.5-1.5b",
        )
    short = short_model(name)
    repo = short[0] if short else name
    # Dummy weights never justify a download of the real ones; a short name has its config built in.
    dummy = load_format == "dummy"
    local, tried = _find_on_hub(repo, weights=not dummy, download=not (short and dummy))
    if local is not None:
        return config_from_dir(local), local
    if short and dummy:
        return short[1], None
    online = f"go online (unset HF_HUB_OFFLINE) so that {repo!r} can be downloaded; " if _hf_offline() else ""
    raise InvalidParam(
        "model",
        f"cannot resolve model {name!r}: it is not a local directory; {'; '.join(tried)}. "
        f"Ways out: pass a local path to a Hugging Face-format model directory; {online}or use load_format='dummy' "
        f"with a short name ({', '.join(short_names())}, optionally with -base) for random weights.",
    )


def _find_on_hub(repo: str, weights: bool, download: bool) -> tuple[str | None, list[str]]:
    """Look for repo in the HF cache, then download it when allowed and online; say what was tried."""
    from huggingface_hub import constants, snapshot_download  # lazy: only resolution needs the hub client

    patterns = None if weights else _NO_WEIGHTS
    try:  # any hub failure (missing repo, network, bad id) is one attempt of the list
        return snapshot_download(repo, local_files_only=True, allow_patterns=patterns), []
    except Exception:
        tried = [f"{repo!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"]
    if not download:
        return None, tried
    if _hf_offline():
        return None, tried + ["no download was tried because HF_HUB_OFFLINE is set"]
    try:
        return snapshot_download(repo, local_files_only=False, allow_patterns=patterns), tried
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return None, tried + [f"downloading {repo!r} from the Hugging Face hub failed ({reason})"]


def _hf_offline() -> bool:
    # Read at call time: huggingface_hub reads its own constant once, at import.
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def config_from_dir(model_dir: str | Path) -> ModelConfig:
    """Read config.json (and generation_config.json for EOS ids) of a model directory of a family we run."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json: pass a Hugging Face-format model directory")
    cfg = json.loads(path.read_text())
    architecture = _check_supported(cfg, path)
    block, scaling = _fp8_block_size(cfg, path), _rope_scaling(cfg, path)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    return ModelConfig(
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        vocab_size=cfg["vocab_size"],
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 1e6),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        eos_token_ids=_eos_ids(Path(model_dir), cfg),
        architecture=architecture,
        rope_scaling=None if scaling is None else {k: scaling[k] for k in _LLAMA3_KEYS} | {"rope_type": "llama3"},
        quantization="fp8" if block else None,
        weight_block_size=block,
    )


_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _check_supported(cfg: dict, path: Path) -> str:
    """The architecture Pico-vLLM runs for this config.json; a clear error for any it does not."""
    archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type"), "unknown")]
    if archs[0] not in ARCHITECTURES or _MODEL_TYPES.get(cfg.get("model_type")) != archs[0]:
        raise ValueError(
            f"{path}: architecture {archs} (model_type={cfg.get('model_type')!r}) is not supported: Pico-vLLM "
            f"runs {', '.join(ARCHITECTURES)} (model_type {', '.join(map(repr, _MODEL_TYPES))}), e.g. Qwen2.5, "
            "Qwen3 and Llama 3"
        )
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window=true is not supported: use a model without it")
    if archs[0] != "Qwen2ForCausalLM" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ValueError(
            f"{path}: attention_bias / mlp_bias true is not supported for {archs[0]}: "
            "use a checkpoint without biases (as the published ones)"
        )
    return archs[0]


def _fp8_block_size(cfg: dict, path: Path) -> list[int] | None:
    """An FP8 checkpoint's weight_block_size (Qwen's format), None unquantized; a clear error for other schemes."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method, block = quant.get("quant_method", "unknown"), quant.get("weight_block_size")
    if method != "fp8":
        raise ValueError(
            f"{path}: quant_method={method!r} is not supported: Pico-vLLM runs FP8 checkpoints "
            "(quant_method 'fp8', block-quantized as Qwen's) and float32/float16/bfloat16 ones (with "
            "quantization='fp8' to quantize them at load); use one of those"
        )
    rows, columns = block if isinstance(block, list) and len(block) == 2 else (0, 0)
    good_block = rows >= 1 and columns >= 16 and columns & (columns - 1) == 0
    if quant.get("fmt", "e4m3") != "e4m3" or quant.get("activation_scheme", "dynamic") != "dynamic" or not good_block:
        raise ValueError(
            f"{path}: this FP8 checkpoint (fmt={quant.get('fmt')!r}, activation_scheme="
            f"{quant.get('activation_scheme')!r}, weight_block_size={block!r}) is not supported: "
            "Pico-vLLM runs e4m3 weights with dynamic activations and weight_block_size [rows, columns] "
            "(columns a power of two >= 16), as Qwen publishes them"
        )
    return list(block)


def _rope_scaling(cfg: dict, path: Path) -> dict | None:
    """config.json's llama3 RoPE scaling (rope_scaling, or transformers 5's rope_parameters), else None."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "llama3" and all(k in scaling for k in _LLAMA3_KEYS):
        return scaling
    if kind != "default":
        raise ValueError(
            f"{path}: rope scaling {kind!r} is not supported: Pico-vLLM runs unscaled RoPE and "
            f"llama3 scaling (with {', '.join(_LLAMA3_KEYS)})"
        )
    return None


def _eos_ids(model_dir: Path, cfg: dict) -> list[int]:
    gen = model_dir / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos = cfg.get("eos_token_id") if eos is None else eos
    return [] if eos is None else [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
