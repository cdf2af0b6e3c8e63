"""Structured outputs in the scheduler: grammars compiled off the loop (cached by their text, with a time limit),
an xgrammar matcher per constrained request, and the packed token bitmask of a step's constrained rows.

xgrammar (and with it torch, on the CPU) and the model's tokenizer load at the first constrained request, in the
compile thread: an engine that never sees one never loads them."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future

from protocol.grammar import build_grammar
from protocol.shared_masks import SharedMasks

COMPILE_TIMEOUT_S = 10.0  # a request whose grammar compiles longer ends with an error (the compile runs on)
MAX_CACHED = 512  # compiled grammars kept by their text
FILL_THREADS = max(2, min(16, (os.cpu_count() or 1) - 4))  # the cores that the worker, loop and frontend leave
LOOP_ROWS = 4  # fewer rows fill in the loop: handing them to threads costs more than it saves


class Grammars:
    """Compiles SamplingParams.structured_outputs against the model's vocabulary."""

    def __init__(
        self,
        model: str,
        model_path: str | None,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        masks_path: str | None = None,
        max_rows: int = 1,
    ) -> None:
        self._model, self._model_path = model, model_path
        self._masks_path, self._max_rows = masks_path, max_rows  # the shared mask file, made at the first fill
        self.vocab_size, self._eos = vocab_size, sorted(eos_token_ids)
        self._cache: dict[str, Future] = {}  # the spec's canonical text -> its compile
        self._lock = threading.Lock()
        self._compiler = None
        self._batch = self._masks = None  # xgrammar's BatchGrammarMatcher and the SharedMasks, made at need

    def compile(self, spec: dict) -> Future:
        """A future of the compiled grammar; a spec seen before shares its first compile (and its failure)."""
        key = json.dumps(spec, sort_keys=True)
        if (future := self._cache.get(key)) is None:
            if len(self._cache) >= MAX_CACHED:
                del self._cache[next(iter(self._cache))]
            future = self._cache[key] = Future()
            # A daemon thread per new grammar: one that never finishes must not hold the process at exit.
            threading.Thread(target=self._compile_to, args=(future, spec), name="grammar-compile", daemon=True).start()
        return future

    def late(self, future: Future) -> bool:
        """The compile has run past COMPILE_TIMEOUT_S (loading xgrammar and the tokenizer first does not count)."""
        started = getattr(future, "started", None)
        return started is not None and time.monotonic() - started > COMPILE_TIMEOUT_S

    def matcher(self, compiled: object) -> object:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

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
            future.started = time.monotonic()
            future.set_result(compiler.compile_grammar(build_grammar(spec)))
        except Exception as e:  # the request's error: InvalidParam for a bad spec, else why the compiler failed
            future.set_exception(e)

    def _get_compiler(self) -> object:
        with self._lock:
            if self._compiler is None:
                import torch
                import xgrammar as xgr

                from frontend.tokenizer import load_tokenizer  # the same offline tokenizer as the frontend's

                tokenizer = load_tokenizer(self._model, self._model_path)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                torch.set_num_threads(1)  # its CPU ops here are small: idle OpenMP threads would spin on every core
            return self._compiler
