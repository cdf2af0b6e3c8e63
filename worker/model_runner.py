"""ModelRunner: one worker rank's model, KV cache and row mirror, running one StepPlan per call (worker/startup.py
builds it). A decode row's input is the token it sampled last, still on the device (last_token[row]): no token
crosses back from the host, so step N+1 can be launched before step N is collected."""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from protocol.config import EngineConfig
from protocol.messages import StepPlan, StepResult
from worker.attention import AttentionBackend, Views
from worker.cuda_graphs import CudaGraphs
from worker.input_buffers import StepBuffers
from worker.prompt_logprobs import PromptLogprobs
from worker.row_mirror import HostStep, RowMirror
from worker.sampler import Sampler, SamplerOutput
from worker.step_output import Draw, Launched, step_result

NO_LANES = np.zeros(0, np.int64)  # a step without masked rows


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: torch.nn.Module, device: torch.device, max_batch: int, max_tokens: int
    ) -> None:
        """max_batch, max_tokens: the most rows and tokens a step stages (a padded graph's included)."""
        self.config, self.model, self.device = config, model, device
        self.model_config = config.model_config
        self.max_rows = config.max_num_seqs
        self.dummy_row = self.max_rows  # padded lanes of a graph read and write this spare row
        self.max_blocks = -(-config.max_model_len // config.block_size)
        self.step = 0
        # One row more than the engine's: the dummy row of padded graph lanes.
        self.sampler = Sampler(self.max_rows + 1, self.model_config.vocab_size, device, max_batch)
        self.prompt_logprobs = PromptLogprobs(self.max_rows)
        self.last_token = torch.zeros(self.max_rows + 1, dtype=torch.int64, device=device)
        block_tables = torch.zeros(self.max_rows + 1, self.max_blocks, dtype=torch.int32, device=device)
        qkv = model.model.layers[0].self_attn.qkv_proj
        self.num_kv_heads = qkv.num_kv_heads  # this rank's
        self.attention = AttentionBackend(block_tables, qkv.num_kv_heads, qkv.num_heads // qkv.num_kv_heads, max_batch)
        self.buffers = StepBuffers(max_tokens, max_batch, self.max_rows * self.max_blocks, self.attention, device)
        samples = max(self.max_rows, max_tokens)  # a verify row samples after each of its tokens
        self._host_tokens = [
            torch.zeros(samples, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)
        ]
        self._done_events = [torch.cuda.Event() for _ in range(2)] if device.type == "cuda" else []
        self._out_turn = 0
        # Start-up sets these: the sized KV cache, its mirror, the captured graphs and each stage's seconds.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_kv_blocks = 0
        self.mirror: RowMirror | None = None
        self.graphs = CudaGraphs(self.dummy_row, graphs=False)
        self.startup: dict = {}

    def use_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches, self.num_kv_blocks = kv_caches, kv_caches[0][0].shape[0]
        self.mirror = RowMirror(self.max_rows, self.max_blocks, self.config.block_size, self.num_kv_blocks)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> Launched:
        """Queue a step without masked rows; nothing waits for the device."""
        return self.sample(self.forward(plan))

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> Launched:
        """Apply the plan's deltas and queue its forward; sample() then draws. At most one launched step may stay
        uncollected: staging and output buffers alternate between two."""
        if plan.step != self.step + 1:
            raise ValueError(f"StepPlan step {plan.step} after step {self.step}: plans must come one by one")
        self.step = plan.step
        start_ns = time.perf_counter_ns()
        events = None
        if plan.trace and self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        # Rows freed by earlier steps go first: none of them is scheduled here, and a new row may reuse one.
        self.mirror.free(plan.free_rows)
        for row in plan.free_rows.tolist():
            self.sampler.remove_row(row)
            self.prompt_logprobs.remove_row(row)
        self._apply_row_deltas(plan)
        step = self.mirror.plan(plan)
        masked = self._mask_lanes(plan, step)
        size = self.graphs.size_for("decode" if step.is_decode else "prefill", len(step.positions))
        self.buffers.write(step, self.mirror.host_input_ids(step), self.mirror.take_deltas(), self.dummy_row, size)
        idx = self.buffers.view("delta_idx")
        if idx.numel():
            self.attention.block_tables.view(-1).index_copy_(0, idx, self.buffers.view("delta_val"))
        draw, prompt_logprobs = self._run_decode(step, size) if step.is_decode else self._run_mixed(step, size)
        self.mirror.finish(step)
        launched = Launched(plan.step, step.samples, draw, masked, prompt_logprobs=prompt_logprobs)
        if len(step.verify):
            launched.verify = _verify_samples(step)
        if plan.trace:
            launched.trace = (start_ns, events, step.is_decode)
        return launched

    @torch.inference_mode()
    def sample(self, launched: Launched, mask: np.ndarray | None = None) -> Launched:
        """Draw the step's tokens (mask: its masked rows' GrammarMask rows) and queue their copy to the host."""
        rows = 0 if mask is None else len(mask)
        if len(launched.masked) != rows:
            raise ValueError(f"step {launched.step} has {len(launched.masked)} masked rows and {rows} mask rows")
        out = launched.draw(None if mask is None else (launched.masked, mask))
        if launched.trace is not None:
            _, events, _ = launched.trace
            if events is not None:
                events[1].record()  # the GPU timer stops after the draw
        self._copy_out(launched, out)
        launched.launched_ns = time.perf_counter_ns()
        return launched

    def _mask_lanes(self, plan: StepPlan, step: HostStep) -> np.ndarray:
        """The index among the step's sampled rows of each masked row."""
        if not len(plan.masked):
            return NO_LANES
        if len(plan.verify):  # lanes count one sample per row
            raise ValueError(f"StepPlan {plan.step} has both masked and verify rows: plan them in separate steps")
        indices = plan.masked.astype(np.int64)
        if indices.min() < 0 or indices.max() >= len(step.rows) or not step.samples[indices].all():
            raise ValueError(f"StepPlan {plan.step} masks rows {indices.tolist()}: each must index a sampling row")
        return np.cumsum(step.samples)[indices] - 1

    def is_done(self, launched: Launched) -> bool:
        return launched.done is None or launched.done.query()

    def collect(self, launched: Launched) -> StepResult:
        """The step's tokens, aligned with plan.rows (-1: a row still mid-prompt)."""
        if launched.done is not None:
            launched.done.synchronize()
        return step_result(launched)

    def _copy_out(self, launched: Launched, out: SamplerOutput | None) -> None:
        self._out_turn ^= 1
        if out is not None:
            launched.tokens = self._host_tokens[self._out_turn][: out.token_ids.shape[0]]
            launched.tokens.copy_(out.token_ids, non_blocking=True)
            if out.logprobs is not None:  # rare: fresh host tensors are fine here
                launched.logprobs = tuple(
                    None if t is None else t.to("cpu", non_blocking=True)
                    for t in (out.logprobs, out.top_ids, out.top_logprobs)
                )
        if launched.prompt_logprobs is not None:
            host = [t.to("cpu", non_blocking=True) for t in launched.prompt_logprobs["tensors"]]
            launched.prompt_logprobs["tensors"] = host
        if self.device.type == "cuda":
            launched.done = self._done_events[self._out_turn]
            launched.done.record()

    def _apply_row_deltas(self, plan: StepPlan) -> None:
        for new in plan.new_rows:
            self.mirror.enter_row(new)
            tokens = np.asarray(new.token_ids)
            prompt = new.num_prompt_tokens
            self.sampler.add_row(new.row, new.sampling, tokens[:prompt], tokens[prompt:])
            self.prompt_logprobs.add_row(new.row, new.sampling.prompt_logprobs, prompt)
        for row, block_ids in plan.block_appends:
            self.mirror.append_blocks(int(row), block_ids)
        for row, computed, token_ids in plan.rewinds:
            self.mirror.rewind(int(row), int(computed), token_ids)

    def decode_forward(self, views: Views, layers: int | None = None) -> tuple[torch.Tensor, SamplerOutput | None]:
        """The body a decode graph captures (static views only); `layers` < all is a warm-up."""
        rows = views["rows"]
        meta = self.attention.decode_metadata(views)
        hidden = self.model(self.last_token, views["positions"], meta, self.kv_caches[:layers], rows)
        logits = self.model.compute_logits(hidden)
        plain = self.sampler.plain  # always, while capturing: no rows yet
        return logits, self.sampler(logits, rows, views["sample_pos"], None, self.last_token) if plain else None

    def prefill_forward(self, views: Views, layers: int | None = None) -> torch.Tensor:
        """The body a prefill graph captures: a prompt step's hidden states, one row per staged token."""
        meta = self.attention.prefill_metadata(views)
        return self.model(views["input_ids"], views["positions"], meta, self.kv_caches[:layers])

    def _run_decode(self, step: HostStep, size: int | None) -> tuple[Draw, None]:
        """Queue a decode step's forward; the draw it returns samples the logits (graph `size`, or eagerly)."""
        b = len(step.rows)
        views = self.graphs.views["decode"][size] if size else self.buffers.decode_views(b)
        self.sampler.sync_params()  # before the graph: its draw reads the rows' temperatures and seeds
        logits, out = self.graphs.replay("decode", size) if size else self.decode_forward(views)
        rows, positions = views["rows"], views["sample_pos"]

        def draw(grammar: tuple[np.ndarray, np.ndarray] | None) -> SamplerOutput:
            if self.sampler.plain:
                return SamplerOutput(out.token_ids[:b])
            if grammar is not None and self.sampler.plain_but_masks:
                # The decode graph's draw again under the masks, as a graph of its own per size: once the mask has
                # come, the host launches one replay, not a handful of kernels.
                self.sampler.stage_masks(*grammar)
                body = functools.partial(self.sampler.masked_draw, logits, rows, positions, self.last_token)
                tokens = self.graphs.replay_or_capture(("masked_draw", size), body) if size else body()
                return SamplerOutput(tokens[:b])
            # Some row needs more than the captured draw: sample the step's logits again, eagerly.
            return self.sampler(logits[:b], rows[:b], positions[:b], step.rows, self.last_token, grammar)

        return draw, None

    def _run_mixed(self, step: HostStep, size: int | None) -> tuple[Draw, dict | None]:
        """A step with prompt chunks, and its prompt logprobs; its decode rows read their input tokens on the device."""
        views = self.graphs.views["prefill"][size] if size else self.buffers.prefill_views()
        num_device = step.num_device_tokens
        if num_device:
            views["input_ids"][:num_device] = self.last_token[views["rows"][:num_device]]
        hidden = self.graphs.replay("prefill", size) if size else self.prefill_forward(views)
        prompt_logprobs = self.prompt_logprobs.compute(self.model, hidden, step, self.mirror)
        if not step.samples.any():
            return _no_draw, prompt_logprobs
        logits = self.model.compute_logits(hidden[self.buffers.view("sample_idx")])
        rows, positions = self.buffers.view("sample_rows"), self.buffers.view("sample_pos")
        rows_host = step.rows[step.sample_points()[0]] if len(step.verify) else step.rows[step.samples]
        draw = functools.partial(self.sampler, logits, rows, positions, rows_host, self.last_token)
        return draw, prompt_logprobs


def _verify_samples(step: HostStep) -> tuple[np.ndarray, np.ndarray]:
    """Indices into a step's samples: each sampling row's last one, and every sample of its verify rows."""
    lanes = step.sample_points()[0]
    last = np.flatnonzero(np.append(lanes[1:] != lanes[:-1], True))
    return last, np.flatnonzero(np.isin(lanes, step.verify))


def _no_draw(grammar: None) -> None:
    """The draw of a step in which no row samples."""
