"""What a launched step leaves behind: its draw, its host copies in flight, and the StepResult they become."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from protocol.messages import StepResult
from worker.sampler import SamplerOutput

Draw = Callable[[tuple[np.ndarray, np.ndarray] | None], SamplerOutput | None]


@dataclass(slots=True)
class Launched:
    """A step queued on the device; ModelRunner.sample draws its tokens, ModelRunner.collect makes its StepResult."""

    step: int
    samples: np.ndarray  # [B] bool: rows whose token is real
    draw: Draw  # samples the step's logits: given (masked lanes, their GrammarMask rows) when it has masked rows
    masked: np.ndarray  # the lane (index among sampled rows) of each masked row
    tokens: torch.Tensor | None = None  # pinned host [S] int64, filled by an asynchronous copy
    logprobs: tuple | None = None  # host (sampled [S], top ids [S, k] | None, top logprobs | None)
    prompt_logprobs: dict | None = None  # PromptLogprobs.compute's, its tensors copied to the host by sample()
    verify: tuple | None = None  # with verify rows: indices into tokens of each row's last sample, of verify samples
    done: torch.cuda.Event | None = None  # recorded after the copies (CUDA only)
    trace: tuple | None = None  # (start_ns, GPU events, is decode) when the plan asks for timings
    launched_ns: int = 0  # when sample() had queued the whole step


def step_result(launched: Launched) -> StepResult:
    """The StepResult of a launched step whose copies have finished: tokens aligned with plan.rows."""
    token_ids = np.full(len(launched.samples), -1, np.int32)
    verify_tokens = None
    if launched.tokens is not None:
        tokens = launched.tokens.numpy()
        if launched.verify is not None:
            last, verify = launched.verify
            tokens, verify_tokens = tokens[last], tokens[verify].astype(np.int32)
            if launched.logprobs is not None:  # of other rows: a verify row asks for none
                launched.logprobs = tuple(None if t is None else t[last] for t in launched.logprobs)
        token_ids[launched.samples] = tokens
    result = StepResult(launched.step, token_ids, _logprobs(launched.logprobs, launched.samples))
    if verify_tokens is not None:
        result.verify_tokens = verify_tokens
    if launched.prompt_logprobs is not None:
        result.prompt_logprobs = _prompt_logprobs(launched.prompt_logprobs)
    if launched.trace is not None:  # host launch span; with CUDA events, GPU time and when the host saw it finish
        start_ns, events, decode = launched.trace
        result.timings = {"start_ns": start_ns, "end_ns": launched.launched_ns, "decode": bool(decode)}
        if events is not None:
            events[1].synchronize()
            result.timings["synced_ns"] = time.perf_counter_ns()
            result.timings["gpu_ns"] = int(events[0].elapsed_time(events[1]) * 1e6)
    return result


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


def _prompt_logprobs(computed: dict) -> dict:
    """StepResult.prompt_logprobs: per asking lane (an index into plan.rows) its first target position and count;
    flat over the targets, their logprobs and ranks, and k top ids and logprobs each."""
    logprobs, ranks, top_ids, top_logprobs = (t.numpy() for t in computed["tensors"])
    return {
        **{name: computed[name].astype(np.int32) for name in ("lanes", "start", "count")},
        "k": computed["k"],
        "logprobs": logprobs,
        "ranks": ranks,
        "top_ids": top_ids.reshape(-1),
        "top_logprobs": top_logprobs.reshape(-1),
    }
