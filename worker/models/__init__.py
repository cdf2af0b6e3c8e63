"""Model definitions, by the architecture name config.json gives (its architectures[0])."""

from __future__ import annotations

from torch import nn

from worker.models.llama import LlamaForCausalLM
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.models.qwen3 import Qwen3ForCausalLM

# Keyed as protocol.config.ARCHITECTURES, which resolution (no torch there) checks config.json against.
MODELS: dict[str, type[nn.Module]] = {
    cls.__name__: cls for cls in (Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM)
}


def model_class(architecture: str) -> type[nn.Module]:
    """The class that runs config.json's architecture; resolution has already refused any other."""
    if architecture not in MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported: Pico-vLLM runs {', '.join(MODELS)}")
    return MODELS[architecture]


__all__ = ["MODELS", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "model_class"]
