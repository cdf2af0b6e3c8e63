"""ModelRunner: the model, its paged KV cache and the row mirror of one worker rank; one StepPlan per call.

A decode step feeds each row the token it sampled last, read on the device (last_token[row]): no token
crosses back from the host. On CUDA a decode-only step replays a captured graph, and so does the model's
forward of a step holding prompt chunks of up to 2,048 tokens (worker/cuda_graphs.py); larger steps run eagerly.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels.decode_attention import few_rows_launch, one_tile_context
from kernels.prefill_attention import prefill_work
from protocol.config import EngineConfig, ModelConfig
from protocol.messages import StepPlan, StepResult
from protocol.sampling import SamplingParams
from worker.attention import AttentionMetadata
from worker.cuda_graphs import StepGraphs, graph_batch_sizes, prefill_buckets, smallest_at_least
from worker.input_buffers import HostStep, RowMirror, StepBuffers
from worker.kv_cache import allocate_kv_cache, cpu_num_kv_blocks, kv_block_bytes, profile_num_kv_blocks
from worker.loader import init_dummy_weights, load_weights
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.parallel import local_kv_heads
from worker.sampler import Sampler, SamplerOutput

# A graph's warm-up runs this many layers: the first (no residual yet) and one as every later layer runs,
# which compiles every kernel variant the full model launches at that batch size, at a fraction of its time.
WARMUP_LAYERS = 2
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def select_device(device: str, rank: int) -> torch.device:
    """'auto' is CUDA when there is a GPU; rank r of a CUDA engine uses GPU r."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA GPU: use device='cpu' or 'auto'")
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def select_dtype(dtype: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's dtype on CUDA and float32 on CPU."""
    if dtype == "auto":
        return _DTYPES.get(model_config.torch_dtype, torch.bfloat16) if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def _resolve(config: EngineConfig) -> tuple[ModelConfig, str | None]:
    if config.model_config is not None:
        return config.model_config, config.model_path
    from protocol.model_config import resolve_model  # only when the launcher did not resolve already

    return resolve_model(config.model, config.load_format)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, tp_size: int = 1) -> None:
        self.config, self.rank, self.tp_size = config, rank, tp_size
        self.model_config, model_dir = _resolve(config)
        self.device = select_device(config.device, rank)
        self.dtype = select_dtype(config.dtype, self.model_config, self.device)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.max_rows = config.max_num_seqs
        self.dummy_row = self.max_rows  # padded lanes of a graph read and write this spare row
        max_blocks = -(-self.max_model_len // config.block_size)
        self.step = 0
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        sizes = graph_batch_sizes(self.max_rows) if use_graphs else []
        # On CUDA a prompt step of up to 2,048 tokens is padded to its token bucket, graphs or not: eager, it
        # runs a graph's shapes (cuBLAS picks its kernels by shape), so the two give the same tokens.
        self.prefill_buckets = prefill_buckets(config.max_num_batched_tokens) if self.device.type == "cuda" else []
        started = time.perf_counter()
        with torch.inference_mode():
            self.model = self._build_model(model_dir)
            weights_done = time.perf_counter()
            # One row more than the engine's: the dummy row that padded graph lanes draw from (temperature 0).
            self.sampler = Sampler(self.max_rows + 1, self.model_config.vocab_size, self.device, config.seed,
                                   self.model_config.eos_token_ids)
            self.last_token = torch.zeros(self.max_rows + 1, dtype=torch.int64, device=self.device)
            self.block_tables = torch.zeros(self.max_rows + 1, max_blocks, dtype=torch.int32, device=self.device)
            self.decode_cu = torch.arange(max(sizes + [self.max_rows]) + 1, dtype=torch.int32, device=self.device)
            self.buffers = StepBuffers(max(sizes + [config.max_num_batched_tokens]), max(sizes + [self.max_rows]),
                                       self.max_rows * max_blocks, self._gqa_group(), self.device)
            pin = self.device.type == "cuda"
            self._host_tokens = [torch.zeros(self.max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
            self._done_events = [torch.cuda.Event() for _ in range(2)] if pin else []
            self._out_turn = 0
            self.num_kv_blocks = self._num_kv_blocks()
            self.mirror = RowMirror(self.max_rows, max_blocks, config.block_size, self.num_kv_blocks)
            self.kv_caches = allocate_kv_cache(self.model_config, self.num_kv_blocks, self._local_kv_heads(),
                                               self.config.block_size, self.dtype, self.device)
            kv_done = time.perf_counter()
            self.graphs = self._graphs("decode", {s: self.buffers.decode_views(s) for s in sizes},
                                       self._decode_forward)
            # A few rows at contexts short enough that every attention split is one tile get graphs of their own,
            # whose attention kernel has no tile loop (kernels/decode_attention.py, one_tile_context).
            self.short_context = self._short_contexts(sizes)
            self.short_graphs = self._graphs("short-context decode",
                                             {s: self.buffers.decode_views(s) for s in self.short_context},
                                             functools.partial(self._decode_forward, short=True))
            decode_done = time.perf_counter()
            buckets = self.prefill_buckets if use_graphs else []
            self.prefill_graphs = self._graphs("prefill", {b: self.buffers.prefill_views(b) for b in buckets},
                                               self._prefill_forward)
        # Seconds per start-up phase, reported in Ready for bench/startup.py.
        self.startup = {"weights_s": weights_done - started, "kv_cache_s": kv_done - weights_done,
                        "graph_capture_s": time.perf_counter() - kv_done,
                        "prefill_capture_s": time.perf_counter() - decode_done,
                        "graph_warmup_s": sum(g.warmup_s for g in (self.graphs, self.short_graphs,
                                                                   self.prefill_graphs) if g)}

    # ---- set-up -------------------------------------------------------------------------------------

    def _build_model(self, model_dir: str | None) -> Qwen2ForCausalLM:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # the layers create their parameters in the default dtype
        try:
            with torch.device(self.device):
                model = Qwen2ForCausalLM(self.model_config, self.rank, self.tp_size)
        finally:
            torch.set_default_dtype(previous)
        if self.config.load_format == "dummy" or model_dir is None:
            init_dummy_weights(model, self.config.seed)
        else:
            load_weights(model, model_dir, self.rank, self.tp_size)
        return model.eval()

    def _gqa_group(self) -> int:
        qkv = self.model.model.layers[0].self_attn.qkv_proj
        return qkv.num_heads // qkv.num_kv_heads

    def _local_kv_heads(self) -> int:
        return local_kv_heads(self.model_config.num_key_value_heads, self.tp_size)

    def _short_contexts(self, sizes: list[int]) -> dict[int, int]:
        """Decode graph size -> the longest context its short-context graph serves (block tables that wide)."""
        out = {}
        for size in sizes:
            blocks = one_tile_context(size, self._local_kv_heads()) // self.config.block_size
            if 0 < blocks * self.config.block_size < self.max_model_len:
                out[size] = blocks * self.config.block_size
        return out

    def _graphs(self, name: str, views: dict, forward) -> StepGraphs | None:
        """forward captured per size over `views` (none: no graphs); warm-ups run WARMUP_LAYERS layers."""
        if not views:
            return None
        graphs = StepGraphs(name, views, forward, self.dummy_row, functools.partial(forward, layers=WARMUP_LAYERS))
        graphs.capture()
        return graphs

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        block_bytes = kv_block_bytes(self.model_config, self._local_kv_heads(), self.config.block_size, self.dtype)
        if self.device.type == "cpu":
            return cpu_num_kv_blocks(-(-self.max_model_len * self.max_rows // self.config.block_size), block_bytes)
        return profile_num_kv_blocks(self.config.gpu_memory_utilization, block_bytes, self._profile_forward)

    def _profile_forward(self) -> None:
        """A step of max_num_batched_tokens prompt tokens plus full sampling, against a one-block cache."""
        mc, bs = self.model_config, self.config.block_size
        tokens = self.config.max_num_batched_tokens
        seq = min(tokens, self.max_model_len)
        cu_host = np.array(list(range(0, tokens, seq)) + [tokens])
        cu = torch.tensor(cu_host, dtype=torch.int32, device=self.device)
        lens = cu[1:] - cu[:-1]
        positions = torch.arange(tokens, device=self.device) - cu[:-1].repeat_interleave(lens).long()
        heads = self._local_kv_heads()
        cache = [(torch.zeros(1, heads, bs, mc.head_dim, dtype=self.dtype, device=self.device),) * 2
                 for _ in range(mc.num_hidden_layers)]
        work = torch.from_numpy(prefill_work(np.diff(cu_host), self._gqa_group())).to(self.device)
        meta = AttentionMetadata(torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
                                 torch.zeros(len(lens), -(-seq // bs), dtype=torch.int32, device=self.device),
                                 lens, cu, work)
        hidden = self.model(torch.zeros(tokens, dtype=torch.int64, device=self.device), positions, meta, cache)
        self.sampler.profile(self.model.compute_logits(hidden[:min(self.max_rows, tokens)]))

    # ---- one step -----------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step and wait for its tokens: collect(launch(plan))."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        """Apply the plan's deltas and queue the step's work; nothing here waits for the device.

        The host never needs the sampled values, so step N+1 may be launched before step N is collected
        (at most one step may stay uncollected: the staging and output buffers alternate between two).
        """
        if plan.step != self.step + 1:
            raise ValueError(f"StepPlan step {plan.step} after step {self.step}: plans must come one by one")
        self.step = plan.step
        start_ns = time.perf_counter_ns()
        events = self._start_gpu_timer() if plan.trace else None
        # Rows freed by earlier steps go first: none of them is scheduled here, and a new row may reuse one.
        self._free_rows(plan.free_rows)
        self._apply_row_deltas(plan)
        step = self.mirror.plan(plan)
        size = self._padded_size(step)
        self.buffers.write(step, self.mirror.host_input_ids(step), self.mirror.take_deltas(), self.dummy_row, size)
        self._apply_block_table_deltas()
        out = self._run_decode(step, size) if step.is_decode else self._run_mixed(step, size)
        if events is not None:
            events[1].record()
        launched = self._copy_out(plan.step, step.samples, out)
        self.mirror.finish(step)
        if plan.trace:
            launched.trace = (start_ns, time.perf_counter_ns(), events, step.is_decode)
        return launched

    def _padded_size(self, step: HostStep) -> int | None:
        """What the step is staged padded to: a decode step's graph batch size, a prompt step's token bucket."""
        if step.is_decode:
            return smallest_at_least(self.graphs.sizes, len(step.rows)) if self.graphs is not None else None
        return smallest_at_least(self.prefill_buckets, len(step.positions))

    def is_done(self, launched: Launched) -> bool:
        """Whether collect() would return without waiting for the device."""
        return launched.done is None or launched.done.query()

    def collect(self, launched: Launched) -> StepResult:
        """Wait for a launched step's tokens; they are aligned with plan.rows (-1: a row still mid-prompt)."""
        if launched.done is not None:
            launched.done.synchronize()
        token_ids = np.full(len(launched.samples), -1, np.int32)
        if launched.tokens is not None:
            token_ids[launched.samples] = launched.tokens.numpy()
        result = StepResult(launched.step, token_ids, _logprobs(launched.logprobs, launched.samples))
        if launched.trace is not None:
            result.timings = _timings(*launched.trace)
        return result

    def _copy_out(self, step_no: int, samples: np.ndarray, out: SamplerOutput | None) -> Launched:
        """Queue the device->host copies of the sampled tokens (and logprobs) behind the step's work."""
        self._out_turn ^= 1
        launched = Launched(step_no, samples)
        if out is not None:
            launched.tokens = self._host_tokens[self._out_turn][:out.token_ids.shape[0]]
            launched.tokens.copy_(out.token_ids, non_blocking=True)
            if out.logprobs is not None:  # rare: fresh host tensors are fine here
                launched.logprobs = tuple(None if t is None else t.to("cpu", non_blocking=True)
                                          for t in (out.logprobs, out.top_ids, out.top_logprobs))
        if self.device.type == "cuda":
            launched.done = self._done_events[self._out_turn]
            launched.done.record()
        return launched

    def _start_gpu_timer(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        if self.device.type != "cuda":
            return None
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        return events

    def _apply_row_deltas(self, plan: StepPlan) -> None:
        for new in plan.new_rows:
            self.mirror.add(new)
            tokens = np.asarray(new.token_ids)
            self.sampler.add_row(new.row, SamplingParams.from_dict(new.params), tokens[:new.num_prompt_tokens],
                                 tokens[new.num_prompt_tokens:])
        for row, block_ids in plan.block_appends:
            self.mirror.append_blocks(int(row), block_ids)

    def _apply_block_table_deltas(self) -> None:
        idx = self.buffers.view("delta_idx")
        if idx.numel():
            self.block_tables.view(-1).index_copy_(0, idx, self.buffers.view("delta_val"))

    def _free_rows(self, rows: np.ndarray) -> None:
        self.mirror.free(rows)
        for row in np.asarray(rows).tolist():
            self.sampler.remove_row(row)

    def _decode_forward(self, views: dict[str, torch.Tensor], layers: int | None = None,
                        short: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row, the row's last sampled token; the tokens drawn (argmax, or Gumbel-max for rows with
        a temperature) become the new last tokens.

        This is the body a decode graph captures: it reads only static views, allocates from the graph pool.
        `layers` runs only the first few decoder layers (a graph's warm-up); `short` sizes the attention's grid for
        the short contexts of short_context (its block tables cut to that width).
        """
        rows = views["rows"]
        # The embedding reads each row's last token through rows, and so does a few rows' attention each row's
        # block table: no gather kernels before them. Many rows gather their tables once here (few_rows_launch).
        through = few_rows_launch(rows.shape[0], self._local_kv_heads())
        tables = self.block_tables
        if short:
            tables = tables[:, :self.short_context[rows.shape[0]] // self.config.block_size]
        meta = AttentionMetadata(views["slot_mapping"], tables if through else tables[rows],
                                 views["context_lens"], self.decode_cu[:rows.shape[0] + 1],
                                 table_rows=rows if through else None)
        hidden = self.model(self.last_token, views["positions"], meta, self.kv_caches[:layers], rows)
        logits = self.model.compute_logits(hidden)
        drawn = self.sampler.draw(logits, rows, views["sample_pos"], self.last_token)
        return logits, drawn

    def _prefill_forward(self, views: dict[str, torch.Tensor], layers: int | None = None) -> torch.Tensor:
        """The final hidden states of a step with prompt chunks, one row per staged token: the body a prefill
        graph captures (reads only static views). `layers` runs only the first few decoder layers (a warm-up)."""
        meta = AttentionMetadata(views["slot_mapping"], self.block_tables[views["rows"]], views["context_lens"],
                                 views["cu_seqlens_q"], views["work"])
        return self.model(views["input_ids"], views["positions"], meta, self.kv_caches[:layers])

    def _run_decode(self, step: HostStep, size: int | None) -> SamplerOutput:
        graphs = self.graphs
        if size in self.short_context and step.context_lens.max() <= self.short_context[size]:
            graphs = self.short_graphs
        views = graphs.views[size] if size else self.buffers.decode_views(len(step.rows))
        self.sampler.sync_params()  # before the graph: its draw reads the rows' temperatures and seeds
        logits, drawn = graphs.replay(size) if size else self._decode_forward(views)
        b = len(step.rows)
        if self.sampler.drawn_in_graph:
            return SamplerOutput(drawn[:b])
        rows = views["rows"][:b]
        out = self.sampler(logits[:b], rows, views["sample_pos"][:b], step.rows)
        self.last_token.index_copy_(0, rows, out.token_ids)
        return out

    def _run_mixed(self, step: HostStep, size: int | None) -> SamplerOutput | None:
        """A step with prompt chunks: decode rows first take their tokens from the device, then one forward
        (a prefill graph's replay when one holds the step), then sampling of the rows that finish here."""
        buf = self.buffers
        graphs = self.prefill_graphs if size else None
        views = graphs.views[size] if graphs else buf.prefill_views()  # the staged layout: padded to `size`
        nd = step.num_device_tokens
        if nd:
            views["input_ids"][:nd] = self.last_token[views["rows"][:nd]]
        hidden = graphs.replay(size) if graphs else self._prefill_forward(views)
        if not step.samples.any():
            return None
        sample_rows = buf.view("sample_rows")
        logits = self.model.compute_logits(hidden[buf.view("sample_idx")])
        out = self.sampler(logits, sample_rows, buf.view("sample_pos"), step.rows[step.samples])
        self.last_token.index_copy_(0, sample_rows, out.token_ids)
        return out


@dataclass(slots=True)
class Launched:
    """A step queued on the device; ModelRunner.collect turns it into its StepResult."""

    step: int
    samples: np.ndarray  # [B] bool: rows whose token is real
    tokens: torch.Tensor | None = None  # pinned host [S] int64, filled by an asynchronous copy
    logprobs: tuple | None = None  # host (sampled [S], top ids [S, k] | None, top logprobs | None)
    done: torch.cuda.Event | None = None  # recorded after the copies (CUDA only)
    trace: tuple | None = None  # (start_ns, launched_ns, GPU events, is decode) when the plan asks for timings


def _timings(start_ns: int, launched_ns: int, events: tuple | None, decode: bool) -> dict:
    """The host's launch span; with CUDA events, the GPU's time and when the host saw it finish."""
    timings = {"start_ns": start_ns, "end_ns": launched_ns, "decode": bool(decode)}
    if events is not None:
        events[1].synchronize()
        timings["synced_ns"] = time.perf_counter_ns()
        timings["gpu_ns"] = int(events[0].elapsed_time(events[1]) * 1e6)
    return timings


def _logprobs(host: tuple | None, samples: np.ndarray) -> dict | None:
    """StepResult.logprobs aligned with plan.rows (rows without a sample get 0 and id -1)."""
    if host is None:
        return None
    logprobs, ids, top = host
    k = 0 if ids is None else ids.shape[1]
    sampled = np.zeros(len(samples), np.float32)
    top_ids = np.full((len(samples), k), -1, np.int32)
    top_lps = np.zeros((len(samples), k), np.float32)
    sampled[samples] = logprobs.numpy()
    if k:
        top_ids[samples] = ids.numpy()
        top_lps[samples] = top.numpy()
    return {"sampled": sampled, "top_ids": top_ids.reshape(-1), "top_logprobs": top_lps.reshape(-1), "k": k}
