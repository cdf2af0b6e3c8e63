"""The policy: continuous batching, chunked prefill, preemption by recompute, stop checks.
A running request holds a row, mirrored on the workers: its tokens go once (NewRow), then deltas. Computed counts
advance when a step is planned; a result is matched to its plan by step, dropping tokens of requests finished or
preempted since: so step N+1 can be planned before result N returns."""

from __future__ import annotations

import bisect
import itertools
import random
import time
from collections import deque
from operator import attrgetter

from protocol.config import EngineConfig, InvalidParam
from protocol.messages import OVERLOADED, AddRequest, Error, GrammarMask, NewRow, StepPlan, StepResult, TokenBatch, i32
from protocol.sampling import SamplingParams, check_length, check_prompt
from scheduler.block_manager import BlockManager
from scheduler.request import Request, Status
from scheduler.speculation import Speculator
from scheduler.step_results import checked_tokens, split_logprobs, take_prompt_logprobs
from scheduler.structured_outputs import StructuredOutputs

_NO_REQUEST_STATS: dict = {}  # the request_stats of every batch without a first token: encoded, never mutated


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, masks_path: str | None = None) -> None:
        mc = config.model_config
        if mc is None or config.max_model_len is None:
            raise ValueError("EngineConfig.model_config or max_model_len is None: resolve the config first")
        self.config = config
        self.vocab_size, self.max_model_len = mc.vocab_size, config.max_model_len
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: the newest is preempted first
        self.requests: dict[tuple[bytes, str], Request] = {}  # waiting or running, by (client, id)
        self.step = self.num_preemptions = 0
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self._rows_freed: set[int] = set()  # for the next plan's free_rows, unless a NewRow reuses one first
        # step -> per row (request, its num_preemptions then, samples a token, its drafts or None)
        self._in_flight: dict[int, list] = {}
        self._verify_sizes: dict[int, list[int]] = {}  # step -> its verify rows' sample counts, if it has any
        self._arrivals = itertools.count()
        self._rng = random.Random(config.seed)
        self._first_stats: dict[bytes, dict] = {}  # client -> request id -> request_stats, for this result's batch
        self.structured = StructuredOutputs(config, masks_path)
        self.speculator = Speculator(config) if config.speculative_config else None

    def add_request(self, msg: AddRequest, client: bytes) -> list[tuple[bytes, TokenBatch | Error]]:
        """Queue a request; a bad one is answered at once (see refuse)."""
        if (client, msg.request_id) in self.requests:
            reason = f"request_id {msg.request_id!r} is already in use by a live request of this connection"
            return self.refuse(client, msg.request_id, f"{reason}, which goes on: use a unique id")
        try:
            req = self._make_request(msg, client)
        except Exception as e:  # untrusted input, checked before any state changes: it fails alone
            return self.refuse(client, msg.request_id, str(e))
        self.requests[req.client, req.request_id] = req
        if req.params.structured_outputs is not None:
            req.status = Status.COMPILING
            self.structured.start(req)
        else:
            self.waiting.append(req)
        return []

    def admit_compiled(self) -> list[tuple[bytes, TokenBatch]]:
        """Requests whose grammar compiled start waiting; one whose grammar failed or is late ends with an error."""
        ready, failed = self.structured.take_compiled()
        for req in ready:
            req.status = Status.WAITING
            self.waiting.append(req)
        replies = []
        for req, reason in failed:
            self._finish(req)
            replies += self.refuse(req.client, req.request_id, reason)
        return replies

    def take_mask(self) -> GrammarMask | None:
        """The mask of the oldest step in flight, if it has masked rows (StructuredOutputs.take_mask)."""
        return self.structured.take_mask(next(iter(self._in_flight), None))

    def refuse(self, client: bytes, request_id: str | None, reason: str) -> list[tuple[bytes, TokenBatch | Error]]:
        """A request the engine will not run: it finishes with "error", unless no id or a live request's id names
        it; then an Error says why (an id appears in `finished` once per request)."""
        if request_id is None or (client, request_id) in self.requests:
            return [(client, Error(reason, request_id))]
        return [(client, self._batch([(request_id, -1, "error", reason, None)]))]

    def abort_client(self, client: bytes) -> int:
        """A client that vanished: end its requests, answering nobody; return how many there were."""
        reqs = [req for (c, _), req in self.requests.items() if c == client]
        for req in reqs:
            self._finish(req)
        return len(reqs)

    def abort(self, request_ids: list[str], client: bytes) -> list[tuple[bytes, TokenBatch]]:
        """Finish the client's named live requests with "abort"; unknown ids are ignored."""
        updates = []
        for rid in {r for r in request_ids if isinstance(r, str)}:
            if (req := self.requests.get((client, rid))) is not None:
                self._finish(req)
                updates.append((rid, -1, "abort", None, None))
        return [(client, self._batch(updates))] if updates else []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
            "num_cached_tokens": bm.num_cached_tokens,
            **(self.speculator.stats() if self.speculator else {}),
        }

    def _make_request(self, msg: AddRequest, client: bytes) -> Request:
        """The wire's one check of a request; its seed, stop ids and max_tokens are resolved here, for every row."""
        waiting = len(self.waiting) + len(self.structured.compiling)
        if waiting >= self.config.max_waiting_requests:
            raise InvalidParam(
                "request_id",
                f"{OVERLOADED}: {waiting} requests are waiting "
                f"(max_waiting_requests={self.config.max_waiting_requests}); retry later",
            )
        params = SamplingParams.from_dict(msg.params)
        if params.n != 1:
            raise InvalidParam(
                "n",
                f"n={params.n} is invalid here: the engine runs one sequence per request, so "
                "send n requests (with seeds seed, seed + 1, ...) and keep n at 1",
            )
        params.check_vocab(self.vocab_size)
        prompt = check_prompt(msg.prompt_token_ids, self.vocab_size)
        n, bm, capacity = len(prompt), self.block_manager, self.block_manager.num_blocks * self.config.block_size
        max_tokens = check_length(n, params.max_tokens, self.max_model_len)
        if params.max_tokens is None:
            max_tokens = min(max_tokens, max(capacity - n, 1))
        if n + max_tokens > capacity:
            raise InvalidParam(
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} "
                f"tokens would never fit the KV cache ({bm.num_blocks} blocks of {bm.block_size}): "
                "lower max_tokens or give the engine more num_kv_blocks",
            )
        if params.seed is None:  # every row then samples from its own generator, whatever the batch
            params.seed = self._rng.getrandbits(63)
        if not params.ignore_eos:
            params.stop_token_ids = sorted(set(params.stop_token_ids) | self.eos_token_ids)
        req = Request(
            msg.request_id,
            client,
            prompt,
            n,
            params,
            next(self._arrivals),
            max_tokens,
            frozenset(params.stop_token_ids),
            queued_at=time.monotonic(),
        )
        if self.speculator is not None:
            self.speculator.enroll(req)
        return req

    def _finish(self, req: Request) -> None:
        if req.status is Status.RUNNING:
            self._release(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.COMPILING:
            self.structured.cancel(req)
        req.status = Status.FINISHED
        del self.requests[req.client, req.request_id]
        if self.speculator is not None:
            self.speculator.retire(req)

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        self._rows_freed.add(req.row)
        self._free_rows.append(req.row)
        req.row = -1

    def schedule(self) -> StepPlan | None:
        """Plan one step: a token for every decode row, then prompt chunks, within the token budget."""
        budget = self.config.max_num_batched_tokens
        decodes, verifies, appends, preempted = self._schedule_decodes(budget)
        # Longest context first: decode attention launches in plan order, so short rows fill the step's tail.
        decodes.sort(key=attrgetter("num_computed_tokens"), reverse=True)
        budget -= len(decodes) + sum(1 + len(draft) for _, draft in verifies)
        # After a preemption the cache is short: admitting now would only preempt again next step.
        chunks, new_rows = self._schedule_prefills(budget, admit=not preempted)
        if not decodes and not verifies and not chunks:
            return None
        self.step += 1
        # A verify row's chunk is its last token (computed now) and its drafts, after which it samples each time.
        rewinds = [[req.row, req.num_computed_tokens - 1, i32(req.token_ids[-1:] + draft)] for req, draft in verifies]
        scheduled = [(req, 1) for req in decodes] + [(req, 1 + len(draft)) for req, draft in verifies] + chunks
        drafts = [(req, None) for req in decodes] + verifies + [(req, None) for req, _ in chunks]
        self._in_flight[self.step] = [(req, req.num_preemptions, not req.is_prefill, d) for req, d in drafts]
        if verifies:
            self._verify_sizes[self.step] = [1 + len(draft) for _, draft in verifies]
        masked = self.structured.plan_masks(self.step, scheduled)
        plan = StepPlan(
            self.step,
            i32([req.row for req, _ in scheduled]),
            i32([n for _, n in scheduled]),
            new_rows,
            appends,
            i32(sorted(self._rows_freed)),
            self.config.trace_dir is not None,
            i32(masked),
            rewinds,
            i32(range(len(decodes), len(decodes) + len(verifies))),
        )
        self._rows_freed.clear()
        return plan

    def _schedule_decodes(self, budget: int) -> tuple[list[Request], list, list, bool]:
        """A token per decoding row (or a verify chunk of drafts), oldest first, preempting the newest for blocks."""
        bm = self.block_manager
        decodes, verifies, appends, preempted = [], [], [], False
        speculating = self.speculator is not None and self.speculator.active(self.running)
        used = 0  # tokens planned: one per decode row, a verify row's drafts too
        for req in list(self.running):
            if used >= budget:
                break
            if req.status is not Status.RUNNING or req.is_prefill:
                continue
            in_flight = req.last_step in self._in_flight
            if in_flight and (req.rewind_next or speculating and self.speculator.promising(req)):
                continue  # its next step depends on what its drafts gained, or its tokens so far look up drafts
            total = req.num_computed_tokens + 1  # once every step in flight has sampled: plan no unusable token
            if total - req.num_prompt_tokens >= req.max_tokens or total >= self.max_model_len:
                continue
            drafts = speculating and req.drafter is not None and not in_flight
            draft = self.speculator.draft(req, budget - used, self.max_model_len) if drafts else []
            if not bm.may_append(req, total + len(draft)):
                draft = []  # drafts never preempt
            while not bm.may_append(req, total):
                victim = self.running[-1]  # freed whole, recomputed later from prompt + generated tokens
                self._release(victim)
                victim.status, victim.num_computed_tokens, victim.num_row_tokens = Status.WAITING, 0, 0
                victim.num_preemptions += 1
                victim.rewind_next = False  # its NewRow sets the worker's row anew
                self.num_preemptions += 1
                self.waiting.appendleft(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                if new_blocks := bm.append_slot(req, total + len(draft)):
                    appends.append((req.row, i32(new_blocks)))
                req.num_computed_tokens += 1
                bm.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))
                if draft or req.rewind_next:  # after drafts, the mirror's row is reset to the accepted tokens
                    verifies.append((req, draft))
                else:
                    decodes.append(req)
                req.rewind_next, req.last_step = bool(draft), self.step + 1  # the step being planned
                used += 1 + len(draft)
        return decodes, verifies, appends, preempted

    def _schedule_prefills(self, budget: int, admit: bool) -> tuple[list[tuple[Request, int]], list[NewRow]]:
        """Chunks of partly prefilled rows, then of waiting requests admitted first come, first served."""
        chunks: list[tuple[Request, int]] = []
        for req in self.running:
            if budget <= 0:
                break
            if req.is_prefill:
                budget -= self._take_chunk(req, budget, chunks)
        new_rows = []
        while admit and budget > 0 and self.waiting and self._free_rows:
            req = self.waiting[0]
            if not self.block_manager.can_allocate(req):
                break
            self.waiting.popleft()
            req.row = self._free_rows.pop()
            self._rows_freed.discard(req.row)  # the NewRow replaces the row's old mirror: no free_rows entry
            req.num_computed_tokens = self.block_manager.allocate(req)
            if req.first_stats is None:  # its first admission: what only the engine knows, sent with its first token
                req.first_stats = {
                    "queue_time": time.monotonic() - req.queued_at,
                    "num_cached_tokens": req.num_computed_tokens,
                }
            req.num_row_tokens, req.status = req.num_tokens, Status.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival)
            sampling = req.params.row_sampling()
            if not req.wants_prompt_logprobs:  # all sent before a preemption: the recompute makes none
                sampling.prompt_logprobs = -1
            new_rows.append(
                NewRow(
                    req.row,
                    i32(req.token_ids),
                    req.num_prompt_tokens,
                    req.num_computed_tokens,
                    i32(req.block_table),
                    sampling,
                )
            )
            budget -= self._take_chunk(req, budget, chunks)
        return chunks, new_rows

    def _take_chunk(self, req: Request, budget: int, chunks: list) -> int:
        n = min(req.num_row_tokens - req.num_computed_tokens, budget)
        req.num_computed_tokens, req.last_step = req.num_computed_tokens + n, self.step + 1
        # Registered now, a block this step fills can serve a request admitted later in the same step.
        self.block_manager.cache_blocks(req, req.num_computed_tokens)
        chunks.append((req, n))
        return n

    def on_result(self, result: StepResult) -> list[tuple[bytes, TokenBatch]]:
        """Append the sampled tokens, check stops, free finished requests; one TokenBatch per client."""
        scheduled = self._in_flight.get(result.step)
        if scheduled is None:
            raise ValueError(f"StepResult for step {result.step} matches no plan in flight ({sorted(self._in_flight)})")
        tokens, verified = checked_tokens(result, scheduled, self._verify_sizes.pop(result.step, []), self.vocab_size)
        logprobs = split_logprobs(result.logprobs, len(scheduled))
        take_prompt_logprobs(result.prompt_logprobs, scheduled)
        del self._in_flight[result.step]
        updates: dict[bytes, list[tuple]] = {}
        prompt_logprobs: dict[bytes, dict] = {}  # client -> request id -> its prompt logprobs, with its first token
        for i, (req, epoch, samples, draft) in enumerate(scheduled):
            verify_samples = None if draft is None else next(verified)  # taken in order, even if dropped
            if not samples or req.status is not Status.RUNNING or req.num_preemptions != epoch:
                continue  # a chunk, or finished, aborted or preempted since this step was planned
            new = [int(tokens[i])] if draft is None else self.speculator.accept(req, draft, verify_samples)
            lp = logprobs(i, req.params.logprobs) if logprobs and req.params.logprobs is not None else None
            for token in new:
                reason = self._take_token(req, token)
                updates.setdefault(req.client, []).append((req.request_id, token, reason, None, lp))
                if reason is not None:
                    break
            if req.num_tokens - req.num_prompt_tokens == 1:
                self._first_stats.setdefault(req.client, {})[req.request_id] = req.first_stats
                if req.params.prompt_logprobs is not None:
                    held = req.prompt_logprobs or [[], [], [], []]  # a one-token prompt has none
                    prompt_logprobs.setdefault(req.client, {})[req.request_id] = held
        return [
            (c, self._batch(u, result.step, self._first_stats.pop(c, _NO_REQUEST_STATS), prompt_logprobs.get(c)))
            for c, u in updates.items()
        ]

    def _take_token(self, req: Request, token: int) -> str | None:
        """Append a sampled token; the request's finish reason if it ends here (it is then finished)."""
        req.token_ids.append(token)
        generated = req.num_tokens - req.num_prompt_tokens
        if generated >= req.params.min_tokens and token in req.stop_ids:
            reason = "stop"
        elif generated >= req.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        elif req.matcher is not None and self.structured.advance(req, token):
            reason = "stop"
        else:
            return None
        self._finish(req)
        return reason

    def _batch(
        self,
        updates: list[tuple],
        step: int | None = None,
        request_stats: dict = _NO_REQUEST_STATS,
        prompt_logprobs: dict | None = None,
    ) -> TokenBatch:
        """One client's (request id, token or -1, finish, error, logprobs) updates, from `step` (default: the last)."""
        ids, tokens, finishes, errors, logprobs = zip(*updates)
        return TokenBatch(
            self.step if step is None else step,
            list(ids),
            i32(tokens),
            {r: f for r, f in zip(ids, finishes) if f is not None},
            {r: e for r, e in zip(ids, errors) if e is not None},
            list(logprobs) if any(lp is not None for lp in logprobs) else None,
            prompt_logprobs,
            self.stats(),
            request_stats,
        )
