"""Everything a caller touches: LLM, AsyncLLM, SamplingParams, the HTTP server, process launch."""

from frontend.async_llm import AsyncLLM
from frontend.llm import LLM
from frontend.output_processor import CompletionOutput, RequestOutput
from protocol.sampling import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
