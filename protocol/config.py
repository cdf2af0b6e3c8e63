"""Engine and model configuration: the typed dataclasses every process is built from."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import msgpack

CACHE_ENV = "PICO_VLLM_CACHE"
# config.json's architectures[0] of the families worker/models runs.
ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")


def cache_root() -> Path:
    """Where every process keeps what it builds once (tokenizer files, timed kernel choices)."""
    return Path(os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "pico-vllm"))


@dataclass(slots=True)
class ModelConfig:
    """The architecture of a model (what config.json says, in our names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    torch_dtype: str = "bfloat16"
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "Qwen2ForCausalLM"  # one of ARCHITECTURES
    # llama3 RoPE scaling: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings; or None.
    rope_scaling: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine is launched with. Field names are the CLI flags in snake_case."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    trace_dir: str | None = None
    max_waiting_requests: int = 4096
    step_timeout: float = 60.0
    # Filled in by resolution at launch, so that child processes need not resolve again.
    model_path: str | None = None
    model_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        require(self.device in ("auto", "cpu", "cuda"), "device", self.device, "use 'auto', 'cpu' or 'cuda'")
        require(self.dtype in ("auto", "float32", "float16", "bfloat16"), "dtype", self.dtype,
               "use 'auto', 'float32', 'float16' or 'bfloat16'")
        require(self.load_format in ("auto", "safetensors", "dummy"), "load_format", self.load_format,
               "use 'auto', 'safetensors' or 'dummy'")
        require(1 <= self.max_num_seqs <= 1024, "max_num_seqs", self.max_num_seqs, "use 1..1024")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens,
               "use a positive number")
        require(self.block_size in (8, 16, 32, 64, 128), "block_size", self.block_size,
               "use 8, 16, 32, 64 or 128")
        require(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks", self.num_kv_blocks,
               "use at least 2, or leave it unset to size the cache from memory")
        require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               self.gpu_memory_utilization, "use a fraction in (0, 1]")
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size,
               "use 1 or more")
        require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", self.max_model_len,
               "use a positive number")
        require(self.step_timeout > 0, "step_timeout", self.step_timeout, "use a positive number of seconds")
        require(isinstance(self.seed, int) and 0 <= self.seed < 2**63, "seed", self.seed,
                "use an integer in [0, 2**63)")
        require(self.max_waiting_requests >= 1, "max_waiting_requests", self.max_waiting_requests, "use 1 or more")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_config"] = self.model_config.to_dict() if self.model_config else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        d = dict(d)
        mc = d.pop("model_config", None)
        cfg = cls(**d)
        cfg.model_config = ModelConfig.from_dict(mc) if mc else None
        return cfg


class InvalidParam(ValueError):
    """A value a caller sent that cannot be served; `field` names it (the `param` of an HTTP 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ContextTooLong(InvalidParam):
    """A prompt, or prompt + max_tokens, longer than max_model_len."""


def require(ok: bool, name: str, value: object, fix: str) -> None:
    """Raise InvalidParam naming the bad value and its fix (the one error shape of every config)."""
    if not ok:
        raise InvalidParam(name, f"{name}={value!r} is invalid: {fix}")


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Raise InvalidParam unless tp_size can shard this architecture (query heads, KV heads, MLP)."""
    heads, kv_heads, name = config.num_attention_heads, config.num_key_value_heads, "tensor_parallel_size"
    if heads % tp_size:
        raise InvalidParam(name, f"{name}={tp_size} does not divide the {heads} query heads: use a divisor of {heads}")
    if config.intermediate_size % tp_size:
        raise InvalidParam(name, f"{name}={tp_size} does not divide the intermediate size {config.intermediate_size}: "
                                 f"use a divisor of it and of the {heads} query heads")
    # KV heads are split when there are enough, else replicated: each rank's query heads must share one.
    if kv_heads % tp_size and tp_size % kv_heads:
        raise InvalidParam(name, f"{name}={tp_size} neither divides nor is a multiple of the {kv_heads} KV heads: use "
                                 "a divisor or a multiple of the KV head count that divides the query heads")


def pack_child_args(config: EngineConfig, addresses: dict, **extra: int) -> bytes:
    """A child process's launch arguments (msgpack on its stdin): its config, the sockets, whose child it is."""
    return msgpack.packb({"config_dict": config.to_dict(), "addresses_dict": addresses, "parent_pid": os.getpid(),
                          **extra})


def unpack_child_args(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)
