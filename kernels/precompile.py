"""Compile-only runs: inside compile_only(), a Triton launch compiles its kernel and does not run it, on a pool of
threads (Triton's AsyncCompileMode), so a dry run of a forward compiles every kernel it launches at once and the real
run after it finds them compiled, with the same specialisations. Triton's compile-only call is run(warmup=True); its
LLVM passes and ptxas release the GIL, so threads overlap most of each compile."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed

from tqdm import tqdm
from triton.runtime._async_compile import AsyncCompileMode
from triton.runtime.jit import JITFunction

_active = False


def compiling_only() -> bool:
    """Whether launches only compile now: nothing runs, so nothing may be timed."""
    return _active


class _Pool(ThreadPoolExecutor):
    """A thread pool that keeps each compile's future, for the progress bar."""

    def __init__(self) -> None:
        super().__init__(max_workers=len(os.sched_getaffinity(0)), thread_name_prefix="triton-compile")
        self.futures: list[Future] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = super().submit(fn, *args, **kwargs)
        self.futures.append(future)
        return future


@contextlib.contextmanager
def compile_only(progress: bool = False) -> Iterator[list[Future]]:
    """Launches inside only compile, in parallel; on exit, waits for every compile (a bar with progress). Yields the
    compiles' futures. A compile that fails is left to the real launch, which raises as it would have."""
    global _active
    if _active:
        raise RuntimeError("compile_only() is already active: a dry run cannot hold another")
    launch = JITFunction.run

    def compile_kernel(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run, _active = compile_kernel, True
    try:
        with _Pool() as pool, AsyncCompileMode(pool, ignore_errors=True):
            yield pool.futures
            for _ in tqdm(as_completed(pool.futures), total=len(pool.futures), unit="kernel",
                          desc=f"Compiling {len(pool.futures)} Triton kernels", disable=not progress):
                pass
    finally:
        JITFunction.run, _active = launch, False
