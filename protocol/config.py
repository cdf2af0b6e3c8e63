"""Engine and model configuration: the typed dataclasses every process is built from."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import msgpack

# config.json's architectures[0] of the families worker/models runs.
ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
# vLLM's --kv-cache-dtype values we serve: the model's dtype, or float8 e4m3 under either name.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def cache_root() -> Path:
    """Where every process keeps what it builds once (tokenizer files, timed kernel choices)."""
    return Path(os.environ.get("PICO_VLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pico-vllm"))


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
    quantization: str | None = None  # "fp8": linear weights in e4m3 (EngineConfig's, or the checkpoint's)
    weight_block_size: list[int] | None = None  # an FP8 checkpoint's scale block [rows, columns]; None: per channel

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


MAX_SPECULATIVE_TOKENS = 16
_SPEC = "speculative_config"


@dataclass(slots=True)
class SpeculativeConfig:
    # "ngram" drafts from the request's own tokens; "suffix" from them and from recent requests' (agent loops and
    # retries repeat earlier outputs), drafting more tokens the longer the match (vLLM's names).
    method: str = "ngram"
    num_speculative_tokens: int | None = None  # draft tokens a row verifies per step, at most (ngram: 4)
    # The longest and shortest n-gram of the sequence's end looked up in it (vLLM: both 5 unset, else the other's).
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int = 8  # more running rows than this: no row drafts (the step is compute-bound)
    suffix_decoding_max_tree_depth: int = 24  # suffix: the longest match looked up (the shortest is 1)
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: drafts per step at most this times the match's length
    # suffix: the finished requests whose tokens are searched; each lookup scans them all (no suffix tree).
    suffix_decoding_max_cached_requests: int = 64

    def __post_init__(self) -> None:
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min or 5
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = MAX_SPECULATIVE_TOKENS if self.method == "suffix" else 4
        tokens, lookup_max, lookup_min = self.num_speculative_tokens, self.prompt_lookup_max, self.prompt_lookup_min
        factor, cached = self.suffix_decoding_max_spec_factor, self.suffix_decoding_max_cached_requests
        checks = (
            ("method", self.method in ("ngram", "suffix"), "use 'ngram' (prompt lookup) or 'suffix'"),
            (
                "num_speculative_tokens",
                _at_least(tokens, 1) and tokens <= MAX_SPECULATIVE_TOKENS,
                f"use 1..{MAX_SPECULATIVE_TOKENS}",
            ),
            ("prompt_lookup_max", _at_least(lookup_max, 1), "use 1 or more"),
            (
                "prompt_lookup_min",
                _at_least(lookup_min, 1) and lookup_min <= lookup_max,
                f"use 1..prompt_lookup_max={lookup_max}",
            ),
            ("disable_by_batch_size", _at_least(self.disable_by_batch_size, 1), "use 1 or more"),
            ("suffix_decoding_max_tree_depth", _at_least(self.suffix_decoding_max_tree_depth, 1), "use 1 or more"),
            ("suffix_decoding_max_spec_factor", isinstance(factor, int | float) and factor > 0, "use a number above 0"),
            ("suffix_decoding_max_cached_requests", _at_least(cached, 0), "use 0 or more"),
        )
        for name, ok, fix in checks:
            require(ok, f"{_SPEC}.{name}", getattr(self, name), fix)

    @classmethod
    def from_value(cls, value: object) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, or its map (the CLI's JSON, LLM's keyword): an unknown key is an error."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidParam(_SPEC, f'{_SPEC} must be a map such as {{"method": "ngram"}}, got {value!r}')
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise InvalidParam(_SPEC, f"{_SPEC} has unknown keys {unknown}: known ones are {sorted(known)}")
        return cls(**value)


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
    allow_remote_shutdown: bool = False  # Shutdown from any frontend, not only the one that started the engine
    quantization: str | None = None  # "fp8": e4m3 linear weights (set by resolution for an FP8 checkpoint)
    kv_cache_dtype: str = "auto"  # "fp8" (or "fp8_e4m3"): the KV cache in e4m3, twice the tokens; auto: the model's
    speculative_config: SpeculativeConfig | dict | None = None  # a map is checked and made a SpeculativeConfig
    # Tensor parallel over hosts, under torch.distributed's names: each node runs an equal share of the ranks.
    nnodes: int = 1
    node_rank: int = 0  # node 0 runs the frontend, the scheduler and ranks 0.. of the group
    master_addr: str = "127.0.0.1"  # node 0's IP: the scheduler's plan and result sockets bind it (not 0.0.0.0)
    master_port: int = 29500  # the group's rendezvous; the scheduler's sockets take the ports after it
    # Filled in at launch (by resolution, then the launcher), so that child processes need not resolve again.
    model_path: str | None = None
    model_config: ModelConfig | None = None
    tokenizer_dir: str | None = None  # holds the tokenizer files that grammars compile against

    def __post_init__(self) -> None:
        for name, valid, fix in _ENGINE_RULES:
            require(valid(getattr(self, name)), name, getattr(self, name), fix)
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        require(tp % nnodes == 0, "nnodes", nnodes, f"use a divisor of tensor_parallel_size={tp}: equal ranks per node")
        require(0 <= self.node_rank < nnodes, "node_rank", self.node_rank, f"use 0..{nnodes - 1}")
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)

    @property
    def local_ranks(self) -> range:
        """The tensor-parallel ranks this node runs."""
        per_node = self.tensor_parallel_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def to_dict(self) -> dict:
        return asdict(self)  # model_config too, as a dict

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        model_config = d.get("model_config")
        return cls(**{**d, "model_config": ModelConfig.from_dict(model_config) if model_config else None})


_ENGINE_RULES = (  # field, valid, fix
    ("device", lambda v: v in ("auto", "cpu", "cuda"), "use 'auto', 'cpu' or 'cuda'"),
    (
        "dtype",
        lambda v: v in ("auto", "float32", "float16", "bfloat16"),
        "use 'auto', 'float32', 'float16' or 'bfloat16'",
    ),
    ("load_format", lambda v: v in ("auto", "safetensors", "dummy"), "use 'auto', 'safetensors' or 'dummy'"),
    ("max_num_seqs", lambda v: 1 <= v <= 1024, "use 1..1024"),
    ("max_num_batched_tokens", lambda v: v >= 1, "use a positive number"),
    ("block_size", lambda v: v in (8, 16, 32, 64, 128), "use 8, 16, 32, 64 or 128"),
    ("num_kv_blocks", lambda v: v is None or v >= 2, "use at least 2, or leave it unset to size the cache from memory"),
    ("gpu_memory_utilization", lambda v: 0.0 < v <= 1.0, "use a fraction in (0, 1]"),
    ("tensor_parallel_size", lambda v: v >= 1, "use 1 or more"),
    ("max_model_len", lambda v: v is None or v >= 1, "use a positive number"),
    ("step_timeout", lambda v: v > 0, "use a positive number of seconds"),
    ("seed", lambda v: isinstance(v, int) and 0 <= v < 2**63, "use an integer in [0, 2**63)"),
    ("max_waiting_requests", lambda v: v >= 1, "use 1 or more"),
    ("nnodes", lambda v: v >= 1, "use 1 or more"),
    ("master_port", lambda v: 1 <= v <= 65000, "use a port in 1..65000 (the sockets take the ports after it)"),
    (
        "quantization",
        lambda v: v in (None, "fp8"),
        "use 'fp8' (weights quantized per output channel at load), or leave it unset",
    ),
    (
        "kv_cache_dtype",
        lambda v: v in KV_CACHE_DTYPES,
        "use 'auto' (the model's dtype) or 'fp8' (float8 e4m3, also spelt 'fp8_e4m3')",
    ),
)


class InvalidParam(ValueError):
    """A value a caller sent that cannot be served; `field` names it (the `param` of an HTTP 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ContextTooLong(InvalidParam):
    """A prompt, or prompt + max_tokens, longer than max_model_len."""


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _at_least(v: object, low: int) -> bool:
    return is_int(v) and v >= low


def require(ok: bool, name: str, value: object, fix: str) -> None:
    """Raise InvalidParam naming the bad value and its fix (the one error shape of every check)."""
    if not ok:
        raise InvalidParam(name, f"{name}={value!r} is invalid: {fix}")


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Raise InvalidParam unless tp_size can shard this architecture (query heads, KV heads, MLP)."""
    heads, kv_heads, name = config.num_attention_heads, config.num_key_value_heads, "tensor_parallel_size"
    if heads % tp_size:
        raise InvalidParam(name, f"{name}={tp_size} does not divide the {heads} query heads: use a divisor of {heads}")
    if config.intermediate_size % tp_size:
        raise InvalidParam(
            name,
            f"{name}={tp_size} does not divide the intermediate size {config.intermediate_size}: "
            f"use a divisor of it and of the {heads} query heads",
        )
    # KV heads are split when there are enough, else replicated: each rank's query heads must share one.
    if kv_heads % tp_size and tp_size % kv_heads:
        raise InvalidParam(
            name,
            f"{name}={tp_size} neither divides nor is a multiple of the {kv_heads} KV heads: use "
            "a divisor or a multiple of the KV head count that divides the query heads",
        )


def pack_child_args(config: EngineConfig, addresses: dict, **extra: int | bytes) -> bytes:
    """A child process's launch arguments (msgpack on its stdin): its config, the sockets, whose child it is."""
    return msgpack.packb(
        {"config_dict": config.to_dict(), "addresses_dict": addresses, "parent_pid": os.getpid(), **extra}
    )


def unpack_child_args(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)
