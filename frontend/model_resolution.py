"""An EngineConfig resolved once, here: model dir, ModelConfig, max_model_len; children resolve nothing."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from protocol.config import EngineConfig, InvalidParam, ModelConfig, check_tp_size

# hidden, intermediate, layers, heads, kv heads, tied: the published Qwen2.5 architectures.
_QWEN25_SIZES = {
    "0.5b": (896, 4864, 24, 14, 2, True),
    "1.5b": (1536, 8960, 28, 12, 2, True),
    "3b": (2048, 11008, 36, 16, 2, True),
    "7b": (3584, 18944, 28, 28, 4, False),
}
_INSTRUCT_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>
_BASE_EOS = [151643]
_NO_WEIGHTS = ["*.json", "*.txt", "*.jinja", "*.tiktoken", "*.model"]  # what dummy weights still need


def resolve_config(config: EngineConfig) -> EngineConfig:
    model_config, model_path = resolve_model(config.model, config.load_format)
    check_tp_size(model_config, config.tensor_parallel_size)
    if config.trace_dir is not None:  # fail at launch, not after the whole run when the trace is written
        try:
            os.makedirs(config.trace_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=config.trace_dir):
                pass
        except OSError as e:
            raise InvalidParam("trace_dir", f"trace_dir={config.trace_dir!r} cannot be written ({e}): pass a "
                                            "writable directory") from None
    config.model_config, config.model_path = model_config, model_path
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        config.max_model_len = limit
    elif config.max_model_len > limit:
        raise InvalidParam("max_model_len", f"max_model_len={config.max_model_len} is over the model's "
                                            f"max_position_embeddings={limit}: use at most {limit}")
    return config


def short_model(name: str) -> tuple[str, ModelConfig] | None:
    """The HF repo id and built-in config of a short name like 'qwen2.5-1.5b[-base]', else None."""
    key = name.lower()
    base = key.endswith("-base")
    size = key.removesuffix("-base").removeprefix("qwen2.5-")
    if not key.startswith("qwen2.5-") or size not in _QWEN25_SIZES:
        return None
    hidden, inter, layers, heads, kv_heads, tied = _QWEN25_SIZES[size]
    config = ModelConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=128, vocab_size=152064 if size == "7b" else 151936,
        tie_word_embeddings=tied, eos_token_ids=list(_BASE_EOS if base else _INSTRUCT_EOS))
    return f"Qwen/Qwen2.5-{size.upper()}" + ("" if base else "-Instruct"), config


def resolve_model(name: str, load_format: str = "auto") -> tuple[ModelConfig, str | None]:
    """--model as a local dir, an HF repo id (cache, then hub when online) or a Qwen2.5 short name; the directory
    is None only for dummy weights of a short name with no files anywhere."""
    path = Path(name).expanduser()
    if path.is_dir():
        return config_from_dir(path), str(path)
    short = short_model(name)
    repo = short[0] if short else name
    # Dummy weights never justify a download of the real ones; a short name has its config built in.
    dummy = load_format == "dummy"
    local, tried = _find_on_hub(repo, weights=not dummy, download=not (short and dummy))
    if local is not None:
        return config_from_dir(local), local
    if short and dummy:
        return short[1], None
    raise InvalidParam("model",
        f"cannot resolve model {name!r}: it is not a local directory; {'; '.join(tried)}. "
        "Ways out: pass a local path to a Hugging Face-format model directory; go online (unset "
        f"HF_HUB_OFFLINE) so that {repo!r} can be downloaded; or use `--load-format dummy` with a short name "
        f"({', '.join('qwen2.5-' + s for s in _QWEN25_SIZES)}, optionally with -base) for random weights.")


def _find_on_hub(repo: str, weights: bool, download: bool) -> tuple[str | None, list[str]]:
    """Look for repo in the HF cache, then download it when allowed and online; say what was tried."""
    from huggingface_hub import constants, snapshot_download  # lazy: only resolution needs the hub client

    # HF_HUB_OFFLINE read at call time: huggingface_hub reads its own constant once, at import.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    tried = []
    for local_only in (True, False):
        if not local_only and (not download or offline):
            if download:
                tried.append("no download was tried because HF_HUB_OFFLINE is set")
            break
        try:
            return snapshot_download(repo, local_files_only=local_only,
                                     allow_patterns=None if weights else _NO_WEIGHTS), tried
        except Exception as e:  # any hub failure (missing repo, network, bad id) is one attempt of the list
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            tried.append(f"{repo!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})" if local_only
                         else f"downloading {repo!r} from the Hugging Face hub failed ({reason})")
    return None, tried


def config_from_dir(model_dir: str | Path) -> ModelConfig:
    """Read config.json (and generation_config.json for EOS ids) of a Qwen2 model directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json: pass a Hugging Face-format model directory")
    cfg = json.loads(path.read_text())
    _check_supported(cfg, path)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    gen = Path(model_dir) / "generation_config.json"  # its EOS ids win over config.json's
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos = cfg.get("eos_token_id") if eos is None else eos
    return ModelConfig(
        hidden_size=hidden, intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, vocab_size=cfg["vocab_size"],
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 1e6),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        eos_token_ids=[] if eos is None else [int(e) for e in eos] if isinstance(eos, list) else [int(eos)])


def _check_supported(cfg: dict, path: Path) -> None:
    archs = cfg.get("architectures") or ["Qwen2ForCausalLM"]
    if cfg.get("model_type") != "qwen2" or "Qwen2ForCausalLM" not in archs:
        raise ValueError(f"{path}: architecture {archs} (model_type={cfg.get('model_type')!r}) is not supported: "
                         "Pico-vLLM runs Qwen2ForCausalLM (model_type 'qwen2') models only, e.g. Qwen2.5")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window=true is not supported: use a model without it")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "unknown")
        raise ValueError(f"{path}: a quantized model (quant_method={method!r}) is not supported: Pico-vLLM runs "
                         "float32/float16/bfloat16 weights; use the unquantized checkpoint "
                         "(e.g. Qwen/Qwen2.5-1.5B-Instruct)")
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ValueError(f"{path}: rope scaling {kind!r} is not supported: remove rope_scaling from config.json")
