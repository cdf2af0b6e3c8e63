"""Model definitions, by the architecture name config.json gives."""
from worker.models.qwen2 import Qwen2ForCausalLM

__all__ = ["Qwen2ForCausalLM"]
