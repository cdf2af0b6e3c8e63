"""RequestOutputs from the engine's TokenBatches (detokenized, stop strings cut); one engine request per sample."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from frontend.detokenizer import IncrementalDetokenizer, StopMatcher, StreamDetokenizer, make_detokenizer
from protocol.messages import AddRequest, TokenBatch, i32
from protocol.sampling import SamplingParams


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" (or "error" with RequestOutput.error)
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob} of sampled + top-k
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    engine_stats: dict | None = None  # TokenBatch.request_stats of its engine request (for /metrics)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def snapshot(self) -> CompletionOutput:
        """A copy the caller may keep while the live output grows."""
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return dataclasses.replace(self, token_ids=list(self.token_ids), logprobs=logprobs)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None  # set when the engine failed the request
    # SamplingParams.prompt_logprobs: per prompt token {token id: logprob} of it and the top k (None for the first),
    # and its rank among the vocabulary (1: the likeliest); with the first output token
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None


@dataclass(slots=True)
class _Sample:
    """One of a request's n samples (its own engine request)."""

    state: RequestState
    out: CompletionOutput
    detok: IncrementalDetokenizer | StreamDetokenizer
    stops: StopMatcher

    def feed(self, text: str) -> tuple[str, str | None]:  # as in vLLM, a stop string counts past min_tokens only
        return self.stops.feed(text, len(self.out.token_ids) > self.state.params.min_tokens)


@dataclass(slots=True)
class RequestState:
    output: RequestOutput
    params: SamplingParams
    engine_ids: list[str]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._samples: dict[str, _Sample] = {}
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()

    def register(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[RequestState, list[AddRequest]]:
        """Start tracking a request: its state, and one AddRequest per sample for the caller to send."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running: use a unique id")
        outs = [
            CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)
        ]
        state = RequestState(RequestOutput(request_id, prompt, list(prompt_ids), outs), params, [])
        msgs = []
        for out in outs:
            engine_id = f"{request_id}#{next(self._ids)}"
            # Sample i of a seeded request uses seed + i, wrapped as the sampler wraps seeds (modulo 2**64).
            seed = None if params.seed is None else params.seed + out.index
            sub = {**params.to_dict(), "n": 1, "seed": seed - 2**64 if seed is not None and seed >= 2**64 else seed}
            if out.index:  # the prompt is the same for every sample: one computes its logprobs
                sub["prompt_logprobs"] = None
            detok = make_detokenizer(
                self.tokenizer, prompt_ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )
            stops = StopMatcher(params.stop, params.include_stop_str_in_output)
            self._samples[engine_id] = _Sample(state, out, detok, stops)
            state.engine_ids.append(engine_id)
            msgs.append(AddRequest(engine_id, i32(prompt_ids), sub))
        self._requests[request_id] = state
        return state, msgs

    def process(self, batch: TokenBatch) -> tuple[list[RequestState], list[str]]:
        """Apply one batch; return the requests it changed and engine ids to abort (stop strings hit)."""
        changed, to_abort, ids = {}, [], batch.request_ids
        for i, engine_id in enumerate(ids):
            sample = self._samples.get(engine_id)
            if sample is None or sample.out.finished:
                continue  # a token for a sample the frontend already ended (stop string, abort)
            token = int(batch.token_ids[i])
            # A request with several tokens in a batch (accepted drafts) has them in a row; its finish ends the last.
            last = i + 1 == len(ids) or ids[i + 1] != engine_id
            reason = batch.finished.get(engine_id) if last else None
            sample.out.engine_stats = batch.request_stats.get(engine_id, sample.out.engine_stats)
            if batch.prompt_logprobs and engine_id in batch.prompt_logprobs:
                _set_prompt_logprobs(sample.state.output, batch.prompt_logprobs[engine_id])
            if token >= 0:
                self._append(sample, token, batch.logprobs[i] if batch.logprobs else None, reason == "stop")
                if sample.out.finished:
                    to_abort.append(engine_id)
            if reason is not None and not sample.out.finished:
                self._finish(sample, reason, batch.errors.get(engine_id))
            changed[sample.state.output.request_id] = sample.state
        return list(changed.values()), to_abort

    def _append(self, sample: _Sample, token: int, logprobs: list | None, stops: bool) -> None:
        """`stops`: the engine ended the sample on this token (EOS or a stop token id)."""
        out = sample.out
        out.token_ids.append(token)
        if logprobs is not None and out.logprobs is not None:
            lp, top_ids, top_lps = logprobs
            out.logprobs.append({token: lp, **dict(zip(top_ids, top_lps))})
        if stops and not sample.state.params.include_stop_str_in_output:
            return  # as in vLLM, the token that stopped the sample is in token_ids but not in the text
        emit, stop = sample.feed(sample.detok.step([token]))
        out.text += emit
        if stop is not None:
            out.stop_reason = stop
            self._finish(sample, "stop")

    def _finish(self, sample: _Sample, reason: str, error: str | None = None) -> None:
        out, state = sample.out, sample.state
        if out.stop_reason is None:  # not ended by a stop string: release what was held back
            emit, stop = sample.feed(sample.detok.flush())
            out.text += emit + sample.stops.flush()
            if stop is not None and reason in ("length", "stop"):  # the held-back text completed a stop string
                out.stop_reason, reason = stop, "stop"
        if reason == "stop" and out.stop_reason is None and out.token_ids:
            out.stop_reason = out.token_ids[-1]
        out.finish_reason = "abort" if reason == "error" else reason
        if error:
            state.output.error = error
        if all(o.finished for o in state.output.outputs):
            state.output.finished = True
            for engine_id in state.engine_ids:
                self._samples.pop(engine_id, None)
            self._requests.pop(state.output.request_id, None)

    def abort(self, request_id: str) -> list[str]:
        """Return its engine ids, for the caller to tell the engine."""
        state = self._requests.get(request_id)
        if state is None:
            return []
        self._end(state, "abort")
        return state.engine_ids

    def fail_all(self, reason: str) -> list[RequestState]:
        """The engine died: every pending request ends with this error."""
        states = list(self._requests.values())
        for state in states:
            self._end(state, "error", reason)
        return states

    def _end(self, state: RequestState, reason: str, error: str | None = None) -> None:
        for sample in [self._samples.get(engine_id) for engine_id in state.engine_ids]:
            if sample is not None and not sample.out.finished:
                self._finish(sample, reason, error)

    @property
    def num_pending(self) -> int:
        return len(self._requests)


def _set_prompt_logprobs(output: RequestOutput, held: list) -> None:
    """RequestOutput's prompt logprobs from the engine's [logprobs, ranks, top ids, top logprobs] of tokens 1..."""
    logprobs, ranks, top_ids, top_lps = held
    targets = output.prompt_token_ids[1:]
    output.prompt_logprobs = [None] + [
        {token: lp, **dict(zip(ids, lps))} for token, lp, ids, lps in zip(targets, logprobs, top_ids, top_lps)
    ]
    output.prompt_ranks = [None, *ranks]
