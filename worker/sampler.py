"""The sampler: logits -> token ids on the device, every row with its own params, no host sync. Host counts of the
rows using each feature let a stage no row needs cost nothing; hashed Gumbel noise makes a seeded row sample the
same tokens alone or in any batch, and again after a preemption."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import apply_token_bitmask_, gumbel_argmax
from protocol.messages import RowSampling

# Column order of the float and int parameter tables: the float one holds these RowSampling fields.
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_TEMP, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(len(_FLOATS))
_TOP_K, _SEED, _MIN_UNTIL = range(3)
_FEATURES = ("random", "penalties", "top_k_top_p", "min_p", "logprobs", "min_tokens", "logit_bias", "grammar")


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N] float32: the sampled token's logprob (raw logits)
    top_ids: torch.Tensor | None = None  # [N, k] int64
    top_logprobs: torch.Tensor | None = None  # [N, k] float32


def upload(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without draining the stream: a pageable copy would wait for the step in flight."""
    src = torch.from_numpy(host)
    if device.type != "cuda":
        return src.to(device)
    return src.pin_memory().to(device, non_blocking=True)


class Sampler:
    """Samples one token per row from logits in the model's dtype; rows are the runner's mirror rows."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, max_lanes: int | None = None) -> None:
        """max_lanes: the rows a step samples at most (a padded decode graph's); max_rows by default."""
        self.vocab_size, self.device, self.max_lanes = vocab_size, device, max_lanes or max_rows
        # Host copies are the truth; the device tables are refreshed from them on steps that add rows.
        self._floats = np.zeros((max_rows, 6), np.float32)
        self._ints = np.zeros((max_rows, 3), np.int64)
        self._floats[:, [_TOP_P, _REPETITION]] = 1.0
        self._feature = {name: np.zeros(max_rows, bool) for name in _FEATURES}
        self._count = dict.fromkeys(_FEATURES, 0)
        self._logprobs_k = np.full(max_rows, -1, np.int64)
        self._dirty = False
        self.floats = torch.from_numpy(self._floats).to(device)
        self.ints = torch.from_numpy(self._ints).to(device)
        self.output_counts = torch.zeros((max_rows, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((max_rows, vocab_size), dtype=torch.bool, device=device)
        self.banned = torch.zeros((max_rows, vocab_size), dtype=torch.bool, device=device)  # before min_tokens
        self.bias = torch.zeros((max_rows, vocab_size), dtype=torch.float32, device=device)  # logit_bias
        self._lanes_host = self._mask = None  # grammar masks: the lane map's pinned copy; on the device [lanes, rows]

    def add_row(self, row: int, params: RowSampling, prompt_ids: np.ndarray, output_ids: np.ndarray) -> None:
        """output_ids: tokens generated before a preemption (they count for penalties)."""
        self.remove_row(row)
        self._floats[row] = [getattr(params, name) for name in _FLOATS]
        # vLLM bans the stop tokens until min_tokens outputs; ids past the vocabulary never come.
        banned = (
            [t for t in params.stop_token_ids if t < self.vocab_size] if params.min_tokens > len(output_ids) else []
        )
        self._ints[row] = (params.top_k, params.seed, len(prompt_ids) + params.min_tokens if banned else 0)
        penalties = (
            params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0
        )
        flags = {
            "random": params.temperature > 0.0,
            "penalties": penalties,
            "top_k_top_p": params.temperature > 0.0 and (params.top_k > 0 or params.top_p < 1.0),
            "min_p": params.temperature > 0.0 and params.min_p > 0.0,
            "logprobs": params.logprobs >= 0,
            "min_tokens": bool(banned),
            "logit_bias": bool(params.logit_bias),
            "grammar": params.grammar,
        }
        for name, on in flags.items():
            self._feature[name][row] = on
            self._count[name] += int(on)
        self._logprobs_k[row] = params.logprobs
        self._dirty = True
        if penalties:
            self.output_counts[row].zero_()
            self.prompt_mask[row].zero_()
            self.prompt_mask[row, upload(np.asarray(prompt_ids, np.int64), self.device)] = True
            if len(output_ids):
                out = upload(np.asarray(output_ids, np.int64), self.device)
                self.output_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        if banned:
            self.banned[row].zero_()
            self.banned[row, upload(np.asarray(banned, np.int64), self.device)] = True
        if params.logit_bias:
            ids = upload(np.fromiter(params.logit_bias, np.int64), self.device)
            self.bias[row, ids] = upload(np.fromiter(params.logit_bias.values(), np.float32), self.device)

    def remove_row(self, row: int) -> None:
        if self._feature["logit_bias"][row]:  # every row in a batch adds its bias row: leave zeros behind
            self.bias[row].zero_()
        for name in _FEATURES:
            self._count[name] -= int(self._feature[name][row])
            self._feature[name][row] = False
        self._logprobs_k[row] = -1

    def profile(self, logits: torch.Tensor) -> None:
        """Every stage once on logits[N], so a memory profile sees the sampler's peak (rows 0..N-1 borrowed)."""
        n = logits.shape[0]
        params = RowSampling(
            top_p=0.9,
            top_k=50,
            min_p=0.05,
            presence_penalty=0.1,
            repetition_penalty=1.1,
            logprobs=20,
            min_tokens=1,
            stop_token_ids=[0],
            logit_bias={0: 1.0},
        )
        empty = np.zeros(0, np.int32)
        for row in range(n):
            self.add_row(row, params, empty, empty)
        rows = np.arange(n, dtype=np.int64)
        zeros = torch.zeros(n, dtype=torch.int64, device=self.device)
        self(logits, torch.from_numpy(rows).to(self.device), zeros, rows, zeros.clone())
        for row in range(n):
            self.remove_row(row)

    @property
    def plain(self) -> bool:
        """No active row needs more than a temperature and a seed: sampling is one draw, which a graph captures."""
        return not self._count["grammar"] and self.plain_but_masks

    @property
    def plain_but_masks(self) -> bool:
        """Only grammars add to the plain draw: a masked draw serves the step (ModelRunner captures it)."""
        return not any(count for name, count in self._count.items() if name not in ("random", "grammar"))

    def sync_params(self) -> None:
        if self._dirty:
            self.floats.copy_(upload(self._floats, self.device))
            self.ints.copy_(upload(self._ints, self.device))
            self._dirty = False

    def __call__(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        rows_host: np.ndarray | None,
        last_token: torch.Tensor,
        grammar: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> SamplerOutput:
        """Sample logits[N, V] for rows[N] and store each token at last_token[row]; positions[N] are the tokens'
        indices in their sequences (the seeds hash them); rows_host is read only for top-k/top-p; grammar is
        (indices into N, their packed bitmasks [k, words]) of the constrained rows."""
        self.sync_params()
        out = SamplerOutput(token_ids=None)  # a plain step skips every stage below but the draw
        if self._count["logprobs"]:  # of the raw logits (vLLM's default); the sampled one is gathered after the draw
            out.logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            k = int(self._logprobs_k.max())
            if k > 0:
                out.top_logprobs, out.top_ids = out.logprobs.topk(k, dim=-1)
        if grammar is not None:
            self.stage_masks(*grammar)
            apply_token_bitmask_(logits, *self._staged_masks())
        if self._count["min_tokens"]:
            early = positions < self.ints[rows, _MIN_UNTIL]
            logits = logits.masked_fill(self.banned[rows] & early[:, None], float("-inf"))
        if self._count["logit_bias"]:
            logits = logits + self.bias[rows]
        if self._count["penalties"]:
            logits = self._apply_penalties(logits, rows)
        out.token_ids = self._sample(logits, rows, positions, rows_host, last_token)
        if self._count["penalties"]:
            self.output_counts.index_put_(
                (rows, out.token_ids), torch.ones_like(rows, dtype=torch.int32), accumulate=True
            )
        if out.logprobs is not None:
            out.logprobs = out.logprobs.gather(1, out.token_ids[:, None]).squeeze(1)
        return out

    def stage_masks(self, lanes: np.ndarray, bitmask: np.ndarray) -> None:
        """A step's masks onto the device: the lane map (the mask row of each sampled row i, -1: none) through a
        pinned buffer, the mask rows [k, words] straight from the shared file. The buffers stay (masked draws' graphs
        read them); the pinned one is reused safely: the step before has finished, and the copy that read it."""
        k, words = bitmask.shape
        if self._mask is None:
            self._lanes_host = torch.empty(self.max_lanes, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._mask = torch.empty(self.max_lanes * (words + 1), dtype=torch.int32, device=self.device)
        host = self._lanes_host.numpy()
        host[:] = -1
        host[lanes] = np.arange(k)
        self._mask[: self.max_lanes].copy_(self._lanes_host, non_blocking=True)
        rows = torch.from_numpy(bitmask).view(-1)
        self._mask[self.max_lanes : self.max_lanes + len(rows)].copy_(rows, non_blocking=True)

    def masked_draw(
        self, logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, last_token: torch.Tensor
    ) -> torch.Tensor:
        """The plain draw (see __call__) under the staged masks: what a masked draw's graph captures."""
        apply_token_bitmask_(logits, *self._staged_masks())
        return self._sample(logits, rows, positions, None, last_token)

    def _staged_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._mask[: self.max_lanes], self._mask[self.max_lanes :].view(self.max_lanes, -1)

    def _apply_penalties(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Repetition as HF/vLLM (prompt or output tokens), frequency and presence as OpenAI (output only)."""
        params = self.floats[rows]
        counts = self.output_counts[rows]
        seen = counts > 0
        rep = params[:, _REPETITION : _REPETITION + 1]
        penalty = torch.where(seen | self.prompt_mask[rows], rep, torch.ones_like(rep))
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = logits - params[:, _FREQUENCY : _FREQUENCY + 1] * counts
        return logits - params[:, _PRESENCE : _PRESENCE + 1] * seen

    def _sample(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        rows_host: np.ndarray,
        last_token: torch.Tensor,
    ) -> torch.Tensor:
        """Random rows draw, greedy rows (temperature 0) take the argmax, in one pass over the logits."""
        if not (self._count["min_p"] or self._count["top_k_top_p"]):
            return gumbel_argmax(logits, self.floats[:, _TEMP], self.ints[:, _SEED], positions, rows, last_token)
        # The filters work on the tempered logits; the draw then only adds noise (temperature 1).
        temps = self.floats[rows, _TEMP]
        logits = logits / torch.where(temps > 0, temps, torch.ones_like(temps))[:, None]
        if self._count["min_p"]:  # drop tokens less likely than min_p times the top token
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * self.floats[rows, _MIN_P, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if self._count["top_k_top_p"]:
            logits = self._apply_top_k_top_p(logits, rows, rows_host)
        tokens = gumbel_argmax(logits, (temps > 0).to(temps.dtype), self.ints[rows, _SEED], positions)
        last_token.index_copy_(0, rows, tokens)
        return tokens

    def _apply_top_k_top_p(self, logits: torch.Tensor, rows: torch.Tensor, rows_host: np.ndarray) -> torch.Tensor:
        """One sort, of only the rows that use top-k or top-p (a host-side choice: no sync)."""
        need = np.flatnonzero(self._feature["top_k_top_p"][rows_host])
        if len(need) == 0:
            return logits
        if len(need) == len(rows_host):
            return _top_k_top_p(logits, self.ints[rows, _TOP_K], self.floats[rows, _TOP_P])
        idx = upload(need, self.device)
        sel_rows = rows[idx]
        logits = logits.clone()
        logits[idx] = _top_k_top_p(logits[idx], self.ints[sel_rows, _TOP_K], self.floats[sel_rows, _TOP_P])
        return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's recipe on an ascending sort; top_k 0 keeps all, top_p 1 keeps all; the best token stays."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    kth = sorted_logits.gather(1, (vocab - k)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    cut = cum <= (1.0 - top_p)[:, None]
    cut[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)
