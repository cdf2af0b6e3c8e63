"""Structured outputs in the scheduler, one owner: grammars compiled off the loop (cached by their text, with a time
limit), an xgrammar matcher per constrained request fed every token it keeps, and each step's packed token bitmask.

xgrammar (and with it torch, on the CPU) and the model's tokenizer load at the first constrained request, in the
compile thread: an engine that never sees one never loads them."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future

from protocol.config import EngineConfig
from protocol.grammar import build_grammar
from protocol.messages import GrammarMask
from protocol.shared_masks import SharedMasks
from scheduler.request import Request, Status

COMPILE_TIMEOUT_S = 10.0  # a request whose grammar compiles longer ends with an error (the compile runs on)
MAX_CACHED = 512  # compiled grammars kept by their text
FILL_THREADS = max(2, min(16, (os.cpu_count() or 1) - 4))  # the cores that the worker, loop and frontend leave
LOOP_ROWS = 4  # fewer rows fill in the loop: handing them to threads costs more than it saves


class StructuredOutputs:
    """Compiles SamplingParams.structured_outputs against the tokenizer in config.tokenizer_dir."""

    def __init__(self, config: EngineConfig, masks_path: str | None = None) -> None:
        self._tokenizer_dir, self.vocab_size = config.tokenizer_dir, config.model_config.vocab_size
        self._eos = sorted(config.model_config.eos_token_ids)
        self._masks_path, self._max_rows = masks_path, config.max_num_seqs  # the shared mask file, made at first fill
        self._one_host = config.nnodes == 1  # workers on other hosts cannot map the mask file
        self._cache: dict[str, Future] = {}  # the spec's canonical text -> its compile
        self._lock = threading.Lock()
        self._compiler = None
        self._batch = self._masks = None  # xgrammar's BatchGrammarMatcher and the SharedMasks, made at need
        self.compiling: dict[Request, Future] = {}  # -> its grammar's compile
        self._mask_rows: dict[int, list[tuple[Request, int]]] = {}  # step -> its masked rows' (request, epoch)

    def start(self, req: Request) -> None:
        """Compile the request's grammar; take_compiled hands it back."""
        self.compiling[req] = self.compile(req.params.structured_outputs)

    def cancel(self, req: Request) -> None:
        """A compiling request that finished: its compile runs on, for the cache."""
        self.compiling.pop(req, None)

    def take_compiled(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The requests whose grammar compiled, each with its matcher; those whose compile failed or is late, and why."""
        ready, failed = [], []
        for req, future in list(self.compiling.items()):
            if future.done():
                del self.compiling[req]
                if future.exception() is None:
                    import xgrammar as xgr

                    req.matcher = xgr.GrammarMatcher(future.result())
                    ready.append(req)
                else:
                    failed.append((req, str(future.exception())))
            elif time.monotonic() - getattr(future, "started", float("inf")) > COMPILE_TIMEOUT_S:
                del self.compiling[req]
                late = f"structured_outputs took over {COMPILE_TIMEOUT_S:.0f} s to compile"
                failed.append((req, f"{late}: simplify the schema or grammar"))
        return ready, failed

    def compile(self, spec: dict) -> Future:
        """A future of the compiled grammar; a spec seen before shares its first compile (and its failure)."""
        key = json.dumps(spec, sort_keys=True)
        future = self._cache.get(key)
        if future is None:
            if len(self._cache) >= MAX_CACHED:
                del self._cache[next(iter(self._cache))]
            future = self._cache[key] = Future()
            # A daemon thread per new grammar: one that never finishes must not hold the process at exit.
            threading.Thread(target=self._compile_to, args=(future, spec), name="grammar-compile", daemon=True).start()
        return future

    def advance(self, req: Request, token: int) -> bool:
        """Feed a constrained request the token it kept; True when that ends it (the grammar is complete or broken)."""
        return not req.matcher.accept_token(token) or req.matcher.is_terminated()

    def plan_masks(self, step: int, scheduled: list[tuple[Request, int]]) -> list[int]:
        """The indices of the step's rows that sample under a mask: constrained rows past their prefill."""
        masked = [i for i, (req, _) in enumerate(scheduled) if req.matcher is not None and not req.is_prefill]
        if masked:
            self._mask_rows[step] = [(scheduled[i][0], scheduled[i][0].num_preemptions) for i in masked]
        return masked

    @property
    def mask_waits(self) -> bool:
        """A step in flight has masked rows: its mask is filled once the step before it returns."""
        return bool(self._mask_rows)

    def take_mask(self, step: int | None) -> GrammarMask | None:
        """The mask of `step`, the oldest step in flight, if it has masked rows: every step before it has its result,
        so each matcher has seen every token before this step's."""
        rows = self._mask_rows.pop(step, None)
        if rows is None:
            return None
        live = [
            req.matcher if req.status is Status.RUNNING and req.num_preemptions == epoch else None
            for req, epoch in rows
        ]
        self.fill(step, live)
        return GrammarMask(step, len(live))

    def fill(self, step: int, matchers: list) -> None:
        """Step `step`'s bitmask row of each matcher (None or terminated: every token allowed) into the shared mask
        file, on FILL_THREADS threads (hundreds of µs a row inside a string)."""
        import xgrammar as xgr

        if self._masks is None:
            self._masks = SharedMasks(self._masks_path, self._max_rows, self.vocab_size, create=True)
        mask = self._masks.slot(step, len(matchers))
        mask.fill(-1)  # all ones
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if len(rows) < LOOP_ROWS:
            for i in rows:
                matchers[i].fill_next_token_bitmask(mask, i)
        else:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(FILL_THREADS)
            self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], mask, rows)

    def _compile_to(self, future: Future, spec: dict) -> None:
        try:
            compiler = self._get_compiler()
            future.started = time.monotonic()  # the time limit starts here: loading xgrammar and the tokenizer is free
            future.set_result(compiler.compile_grammar(build_grammar(spec)))
        except Exception as e:  # the request's error: InvalidParam for a bad spec, else why the compiler failed
            future.set_exception(e)

    def _get_compiler(self) -> object:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer_dir is None:
                    raise ValueError("structured_outputs needs the model's tokenizer files, and this engine has none")
                if not self._one_host:
                    raise ValueError("structured_outputs needs every worker on the scheduler's host: use nnodes=1")
                import torch
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_dir)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                torch.set_num_threads(1)  # its CPU ops here are small: idle OpenMP threads would spin on every core
            return self._compiler
