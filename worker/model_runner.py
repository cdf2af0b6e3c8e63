"""ModelRunner: the model, its paged KV cache and the row mirror of one worker rank; one StepPlan per call.

A decode row's input is the token it sampled last, still on the device (last_token[row]): no token crosses
back from the host, so step N+1 can be launched before step N is collected."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm import tqdm

from protocol.config import EngineConfig, ModelConfig
from protocol.messages import StepPlan, StepResult
from protocol.sampling import SamplingParams
from worker.attention import AttentionBackend, AttentionMetadata, Views
from worker.cuda_graphs import CudaGraphs, graph_batch_sizes, prefill_buckets
from worker.input_buffers import StepBuffers
from worker.kv_cache import allocate_kv_cache, cpu_num_kv_blocks, kv_block_bytes, peak_key, profile_num_kv_blocks
from worker.loader import init_dummy_weights, load_weights
from worker.models import model_class
from worker.parallel import local_kv_heads
from worker.precompile import DryRun, compile_only
from worker.row_mirror import HostStep, RowMirror
from worker.sampler import Sampler, SamplerOutput
from worker.step_output import Launched, step_result

WARMUP_LAYERS = 2  # the first layer (no residual yet) and one like every later one: every kernel variant
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MaskedRows = Callable[[], tuple[np.ndarray, np.ndarray]]  # waits for a step's GrammarMask: (lanes, bitmask rows)


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


def check_fp8_gpu(device: torch.device) -> None:
    """FP8 weights need FP8 conversions in hardware: compute capability 8.9 (Ada) or later."""
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(
            f"quantization='fp8' needs a GPU with FP8 (compute capability 8.9 or later, e.g. L4, H100); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: leave quantization "
            "unset and use an unquantized checkpoint on this GPU"
        )


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, tp_size: int = 1) -> None:
        if config.model_config is None or config.max_model_len is None:
            raise ValueError(
                f"EngineConfig for {config.model!r} is not resolved: pass it through "
                "frontend.model_resolution.resolve_config first"
            )
        self.config, self.rank, self.tp_size = config, rank, tp_size
        self.model_config, model_dir = config.model_config, config.model_path
        self.device = select_device(config.device, rank)
        self.dtype = select_dtype(config.dtype, self.model_config, self.device)
        self.max_model_len = config.max_model_len
        self.max_rows = config.max_num_seqs
        self.dummy_row = self.max_rows  # padded lanes of a graph read and write this spare row
        self.step = 0
        cuda = self.device.type == "cuda"
        use_graphs = cuda and not config.enforce_eager
        # On CUDA a prompt step is padded to its bucket even eagerly: cuBLAS picks kernels by shape, so eager
        # and graphs give the same tokens.
        buckets = prefill_buckets(config.max_num_batched_tokens) if cuda else []
        sizes = graph_batch_sizes(self.max_rows) if use_graphs else []
        max_batch = max(sizes + [self.max_rows])
        self.clock = {"runner_started": time.time()}  # wall-clock marks: worker/process.py reports them
        with torch.inference_mode():
            self.model = self._build_model(model_dir)
            self._mark("weights_loaded")
            self._init_step_state(max_batch, max(sizes + [config.max_num_batched_tokens]))
            views = {
                "decode": {s: self.buffers.decode_views(s) for s in sizes},
                "prefill": {b: self.buffers.prefill_views(b) for b in buckets},
            }
            dry = self._precompile(views) if use_graphs else DryRun()
            self._mark("kernels_compiled")
            self._init_kv_cache()
            self._mark("kv_cache_ready")
            self.graphs = CudaGraphs(self.dummy_row, graphs=use_graphs)
            self._capture(views, warm_up=dry.deferred > 0)
        self.startup = self._stage_seconds(len(dry.futures))

    def _stage_seconds(self, kernels: int) -> dict:
        """Each start-up stage's seconds, for the worker's Ready (compile_s holds the step buffers' allocation too)."""
        c = self.clock
        return {
            "weights_s": c["weights_loaded"] - c["runner_started"],
            "kernels_compiled": kernels,
            "compile_s": c["kernels_compiled"] - c["weights_loaded"],
            "kv_cache_s": c["kv_cache_ready"] - c["kernels_compiled"],
            "graph_capture_s": c["prefill_graphs_captured"] - c["kv_cache_ready"],
            "prefill_capture_s": c["prefill_graphs_captured"] - c["decode_graphs_captured"],
            "graph_warmup_s": self.graphs.warmup_s,
        }

    def _mark(self, name: str) -> None:
        self.clock[name] = time.time()

    def _init_step_state(self, max_batch: int, max_tokens: int) -> None:
        self.max_blocks = -(-self.max_model_len // self.config.block_size)
        # One row more than the engine's: the dummy row of padded graph lanes.
        self.sampler = Sampler(self.max_rows + 1, self.model_config.vocab_size, self.device, max_batch)
        self.last_token = torch.zeros(self.max_rows + 1, dtype=torch.int64, device=self.device)
        block_tables = torch.zeros(self.max_rows + 1, self.max_blocks, dtype=torch.int32, device=self.device)
        self.attention = AttentionBackend(block_tables, self._local_kv_heads(), self._gqa_group(), max_batch)
        self.buffers = StepBuffers(max_tokens, max_batch, self.max_rows * self.max_blocks, self.attention, self.device)
        self._host_tokens = [
            torch.zeros(self.max_rows, dtype=torch.int64, pin_memory=self.device.type == "cuda") for _ in range(2)
        ]
        self._done_events = [torch.cuda.Event() for _ in range(2)] if self.device.type == "cuda" else []
        self._out_turn = 0

    def _init_kv_cache(self) -> None:
        self.num_kv_blocks = self._num_kv_blocks()
        self._mark("kv_profiled")
        self.mirror = RowMirror(self.max_rows, self.max_blocks, self.config.block_size, self.num_kv_blocks)
        self.kv_caches = allocate_kv_cache(
            self.model_config,
            self.num_kv_blocks,
            self._local_kv_heads(),
            self.config.block_size,
            self.dtype,
            self.device,
        )

    def _precompile(self, views: dict[str, dict[int, Views]]) -> DryRun:
        """The Triton kernels of the KV profiling and the captures, compiled and loaded in parallel by a dry run of
        each whose launches only compile (Triton's disk cache serves those it holds). Its torch ops run, on the
        captures' shapes: after it, a capture needs no warm-up unless the run deferred a choice that needs timing."""
        self.kv_caches = self._one_block_cache(WARMUP_LAYERS)  # the real cache's strides; replaced once it is sized
        with compile_only(progress=True) as dry:
            self._profile_forward(WARMUP_LAYERS)
            for kind, forward in (("decode", self._decode_forward), ("prefill", self._prefill_forward)):
                for size_views in views[kind].values():
                    forward(size_views, layers=WARMUP_LAYERS)
        return dry

    def _capture(self, views: dict[str, dict[int, Views]], warm_up: bool) -> None:
        """Every graph of both kinds, under one progress bar; warm_up: an eager run of a few layers before each."""
        with tqdm(
            total=sum(map(len, views.values())),
            desc="Capturing CUDA graphs",
            unit="graph",
            disable=not self.graphs.graphs,
        ) as bar:
            for kind, forward in (("decode", self._decode_forward), ("prefill", self._prefill_forward)):
                if views[kind]:
                    warmup = functools.partial(forward, layers=WARMUP_LAYERS) if warm_up else None
                    self.graphs.capture(kind, views[kind], forward, warmup, bar)
                self._mark(f"{kind}_graphs_captured")

    def _build_model(self, model_dir: str | None) -> torch.nn.Module:
        if self.model_config.quantization and self.device.type == "cuda":
            check_fp8_gpu(self.device)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # the layers create their parameters in the default dtype
        try:
            with torch.device(self.device):
                model = model_class(self.model_config.architecture)(self.model_config, self.rank, self.tp_size)
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

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        block_bytes = kv_block_bytes(self.model_config, self._local_kv_heads(), self.config.block_size, self.dtype)
        if self.device.type == "cpu":
            return cpu_num_kv_blocks(-(-self.max_model_len * self.max_rows // self.config.block_size), block_bytes)
        return profile_num_kv_blocks(
            self.config.gpu_memory_utilization,
            block_bytes,
            self._profile_forward,
            peak_key(self.config, torch.cuda.get_device_name(self.device), self.rank),
        )

    def _one_block_cache(self, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (1, self._local_kv_heads(), self.config.block_size, self.model_config.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),) * 2 for _ in range(layers)]

    def _profile_forward(self, layers: int | None = None) -> None:
        """A step of max_num_batched_tokens prompt tokens plus full sampling, against a one-block cache; with
        `layers`, a compile-only dry run of those layers and no sampling (its torch ops index by the drawn tokens)."""
        tokens = self.config.max_num_batched_tokens
        seq = min(tokens, self.max_model_len)
        cu_host = np.array(list(range(0, tokens, seq)) + [tokens])
        cu = torch.tensor(cu_host, dtype=torch.int32, device=self.device)
        lens = cu[1:] - cu[:-1]
        positions = torch.arange(tokens, device=self.device) - cu[:-1].repeat_interleave(lens).long()
        work = torch.from_numpy(self.attention.work_items(np.diff(cu_host))).to(self.device)
        blocks = -(-seq // self.config.block_size)
        meta = AttentionMetadata(
            torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
            torch.zeros(len(lens), blocks, dtype=torch.int32, device=self.device),
            lens,
            cu,
            work,
        )
        cache = self._one_block_cache(layers or self.model_config.num_hidden_layers)
        hidden = self.model(torch.zeros(tokens, dtype=torch.int64, device=self.device), positions, meta, cache)
        logits = self.model.compute_logits(hidden[: min(self.max_rows, tokens)])
        if layers is None:
            self.sampler.profile(logits)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, wait_mask: Callable[[int], np.ndarray] | None = None) -> Launched:
        """Apply the plan's deltas and queue the step; nothing waits for the device. At most one launched step
        may stay uncollected: staging and output buffers alternate between two. A plan with masked rows samples
        only once wait_mask(step) has its mask rows (the host waits; the step's forward is queued first)."""
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
        masked = functools.partial(self._masked_rows, plan, step, wait_mask) if len(plan.masked) else None
        out = self._run_decode(step, size, masked) if step.is_decode else self._run_mixed(step, size, masked)
        if events is not None:
            events[1].record()
        launched = self._copy_out(plan.step, step.samples, out)
        self.mirror.finish(step)
        if plan.trace:
            launched.trace = (start_ns, time.perf_counter_ns(), events, step.is_decode)
        return launched

    def _masked_rows(
        self, plan: StepPlan, step: HostStep, wait_mask: Callable[[int], np.ndarray] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(indices into the step's sampled rows, bitmask [k, words]) of its masked rows."""
        indices = plan.masked.astype(np.int64)
        if wait_mask is None or indices.min() < 0 or indices.max() >= len(step.rows) or not step.samples[indices].all():
            raise ValueError(
                f"StepPlan {plan.step} masks rows {indices.tolist()}: each must index a sampling row, "
                "and the caller must pass wait_mask"
            )
        mask = wait_mask(plan.step)
        if len(mask) != len(indices):
            raise ValueError(f"GrammarMask for step {plan.step} has {len(mask)} rows, not its {len(indices)} masked")
        return np.cumsum(step.samples)[indices] - 1, mask

    def _padded_size(self, step: HostStep) -> int | None:
        if step.is_decode:
            return self.graphs.size_for("decode", len(step.rows))
        return self.graphs.size_for("prefill", len(step.positions))

    def is_done(self, launched: Launched) -> bool:
        return launched.done is None or launched.done.query()

    def collect(self, launched: Launched) -> StepResult:
        """The step's tokens, aligned with plan.rows (-1: a row still mid-prompt)."""
        if launched.done is not None:
            launched.done.synchronize()
        return step_result(launched)

    def _copy_out(self, step_no: int, samples: np.ndarray, out: SamplerOutput | None) -> Launched:
        self._out_turn ^= 1
        launched = Launched(step_no, samples)
        if out is not None:
            launched.tokens = self._host_tokens[self._out_turn][: out.token_ids.shape[0]]
            launched.tokens.copy_(out.token_ids, non_blocking=True)
            if out.logprobs is not None:  # rare: fresh host tensors are fine here
                launched.logprobs = tuple(
                    None if t is None else t.to("cpu", non_blocking=True)
                    for t in (out.logprobs, out.top_ids, out.top_logprobs)
                )
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
            self.sampler.add_row(
                new.row,
                SamplingParams.from_plan(new.params),
                tokens[: new.num_prompt_tokens],
                tokens[new.num_prompt_tokens :],
            )
        for row, block_ids in plan.block_appends:
            self.mirror.append_blocks(int(row), block_ids)

    def _apply_block_table_deltas(self) -> None:
        idx = self.buffers.view("delta_idx")
        if idx.numel():
            self.attention.block_tables.view(-1).index_copy_(0, idx, self.buffers.view("delta_val"))

    def _free_rows(self, rows: np.ndarray) -> None:
        self.mirror.free(rows)
        for row in np.asarray(rows).tolist():
            self.sampler.remove_row(row)

    def _decode_forward(self, views: Views, layers: int | None = None) -> tuple[torch.Tensor, SamplerOutput | None]:
        """The body a decode graph captures (static views only); `layers` < all is a warm-up."""
        rows = views["rows"]
        meta = self.attention.decode_metadata(views)
        hidden = self.model(self.last_token, views["positions"], meta, self.kv_caches[:layers], rows)
        logits = self.model.compute_logits(hidden)
        plain = self.sampler.plain  # always, while capturing: no rows yet
        return logits, self.sampler(logits, rows, views["sample_pos"], None, self.last_token) if plain else None

    def _prefill_forward(self, views: Views, layers: int | None = None) -> torch.Tensor:
        """The body a prefill graph captures: a prompt step's hidden states, one row per staged token."""
        meta = self.attention.prefill_metadata(views)
        return self.model(views["input_ids"], views["positions"], meta, self.kv_caches[:layers])

    def _run_decode(self, step: HostStep, size: int | None, masked: MaskedRows | None = None) -> SamplerOutput:
        b = len(step.rows)
        views = self.graphs.views["decode"][size] if size else self.buffers.decode_views(b)
        self.sampler.sync_params()  # before the graph: its draw reads the rows' temperatures and seeds
        logits, out = self.graphs.replay("decode", size) if size else self._decode_forward(views)
        if self.sampler.plain:
            return SamplerOutput(out.token_ids[:b])
        if masked and self.sampler.plain_but_masks:
            # The decode graph's draw again under the masks, as a graph of its own per size: once the mask has
            # come, the host launches one replay, not a handful of kernels.
            self.sampler.stage_masks(*masked())
            draw = functools.partial(
                self.sampler.masked_draw, logits, views["rows"], views["sample_pos"], self.last_token
            )
            return SamplerOutput((self.graphs.replay_or_capture(("masked_draw", size), draw) if size else draw())[:b])
        # Some row needs more than the captured draw: sample the step's logits again, eagerly.
        return self.sampler(
            logits[:b], views["rows"][:b], views["sample_pos"][:b], step.rows, self.last_token, masked and masked()
        )

    def _run_mixed(self, step: HostStep, size: int | None, masked: MaskedRows | None = None) -> SamplerOutput | None:
        """A step with prompt chunks; its decode rows take their input tokens from the device."""
        views = self.graphs.views["prefill"][size] if size else self.buffers.prefill_views()
        num_device = step.num_device_tokens
        if num_device:
            views["input_ids"][:num_device] = self.last_token[views["rows"][:num_device]]
        hidden = self.graphs.replay("prefill", size) if size else self._prefill_forward(views)
        if not step.samples.any():
            return None
        logits = self.model.compute_logits(hidden[self.buffers.view("sample_idx")])
        return self.sampler(
            logits,
            self.buffers.view("sample_rows"),
            self.buffers.view("sample_pos"),
            step.rows[step.samples],
            self.last_token,
            masked and masked(),
        )
