"""What crosses a process boundary: messages, the msgpack codec, configs, socket addresses."""
from protocol.codec import ProtocolError, decode, encode
from protocol.config import EngineConfig, ModelConfig
from protocol.sampling import SamplingParams

__all__ = ["EngineConfig", "ModelConfig", "ProtocolError", "SamplingParams", "decode", "encode"]
