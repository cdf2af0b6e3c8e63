"""LLM: the synchronous, offline API; prompts go in as fast as the engine's waiting queue takes them."""

from __future__ import annotations

import atexit
import itertools
from collections import deque
from typing import TYPE_CHECKING

from tqdm import tqdm

from frontend.engine_client import EngineClient, EngineDeadError, Prompt
from frontend.model_resolution import resolve_config
from frontend.output_processor import OutputProcessor, RequestOutput, RequestState
from protocol.config import EngineConfig, SpeculativeConfig
from protocol.messages import Abort, GetStats, TokenBatch
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class LLM:
    """Offline batches: `LLM(model, ...)`, then `generate(prompts, SamplingParams(...))`; a context manager.

    model: a local Hugging Face directory, a Hugging Face repo id, or a short name such as "qwen2.5-1.5b". The keywords
    are EngineConfig's fields (launch.py's flags in snake_case): device "auto" | "cpu" | "cuda"; dtype "auto" (the
    checkpoint's) | "float32" | "float16" | "bfloat16"; load_format "auto" | "safetensors" | "dummy" (random weights);
    seed of dummy weights and sampling; max_model_len: longest prompt + output (default: the model's); max_num_seqs:
    most requests in a batch; max_num_batched_tokens: token budget of one step; block_size: tokens per KV block
    (8..128); num_kv_blocks: a fixed KV cache size (default: from gpu_memory_utilization, the GPU's share to use);
    enable_prefix_caching: reuse the KV of shared prompt prefixes; tensor_parallel_size: GPUs to shard over;
    enforce_eager: no CUDA graphs; trace_dir: write a Perfetto trace there; max_waiting_requests: bound of the waiting
    queue; step_timeout: seconds without progress before the engine counts as dead; quantization "fp8": linear weights
    in float8 e4m3, one scale per output channel (an FP8 checkpoint sets it); kv_cache_dtype "fp8" (or "fp8_e4m3"):
    the KV cache in float8 e4m3, twice the tokens in the same memory ("auto": the model's dtype); speculative_config:
    vLLM's map, e.g. {"method": "ngram", "num_speculative_tokens": 4} (requests verify n-gram drafts of their own
    tokens; "suffix": of recent requests' too);
    nnodes, node_rank, master_addr, master_port: tensor parallel over hosts, this process being node 0 (docs/SCALING.md)."""

    def __init__(
        self,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        load_format: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        trace_dir: str | None = None,
        max_waiting_requests: int = 4096,
        step_timeout: float = 60.0,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        speculative_config: SpeculativeConfig | dict | None = None,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
    ) -> None:
        # Every parameter is an EngineConfig field of the same name (a test keeps the two in step).
        config = resolve_config(EngineConfig(**{k: v for k, v in locals().items() if k != "self"}))
        self.client = EngineClient(config)
        self._max_unfinished = config.max_waiting_requests  # more could be refused as "engine overloaded"
        self.processor = OutputProcessor(self.client.tokenizer)
        self._ids = itertools.count()
        atexit.register(self.shutdown)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.client.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in input order. A prompt is a str or a list of token ids."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and bool(prompts) and all(isinstance(t, int) for t in prompts)
        )
        prompts = [prompts] if single else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts: give one or one each")
        params = [sp or SamplingParams() for sp in params]
        with self.client.tracer.span("frontend.tokenize"):
            unsent = deque((*self.client.prepare(p, sp), sp) for p, sp in zip(prompts, params))
        states, unfinished = [], 0
        with tqdm(total=len(unsent), desc="generate", disable=not use_tqdm) as bar:
            while unsent or self.processor.num_pending:
                unfinished = self._send_while_room(unsent, states, unfinished)
                finished = self._step()
                unfinished -= sum(state.params.n for state in finished)
                bar.update(len(finished))
        for state in states:
            if state.output.error:
                raise RuntimeError(f"request {state.output.request_id} failed: {state.output.error}")
        return [state.output for state in states]

    def _send_while_room(self, unsent: deque, states: list[RequestState], unfinished: int) -> int:
        """Submit prompts while the engine's queue surely has room; return how many engine requests are unfinished."""

        def room() -> bool:
            return bool(unsent) and (not unfinished or unfinished + unsent[0][2].n <= self._max_unfinished)

        if room():
            with self.client.tracer.span("frontend.send"):
                while room():
                    text, ids, params = unsent.popleft()
                    state, msgs = self.processor.register(f"llm-{next(self._ids)}", text, ids, params)
                    for msg in msgs:
                        self.client.send(msg)
                    states.append(state)
                    unfinished += params.n
        return unfinished

    def _step(self) -> list[RequestState]:
        """Wait for one TokenBatch; return the requests it finished."""
        try:
            msg = self.client.recv_blocking()
        except EngineDeadError as e:
            self.processor.fail_all(str(e))
            raise
        if not isinstance(msg, TokenBatch):
            return []
        with self.client.tracer.span("frontend.detokenize", msg.step):
            changed, to_abort = self.processor.process(msg)
        if to_abort:
            self.client.send(Abort(to_abort))
        return [state for state in changed if state.output.finished]

    def stats(self) -> dict:
        """Fresh engine counters (a round trip to the scheduler)."""
        self.client.send(GetStats())
        while True:
            msg = self.client.recv_blocking()
            if isinstance(msg, TokenBatch) and not msg.request_ids:
                return dict(msg.stats)

    def shutdown(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None
            atexit.unregister(self.shutdown)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
