"""Compile-only dry runs: inside compile_only(), a Triton launch compiles, builds and loads its kernel without running
it (run(warmup=True)), on a pool of threads (AsyncCompileMode), so the real run after finds every kernel ready with the
same specialisations. Triton's front end is Python, one GIL for all threads: over a cold cache, a forked child per
kernel compiles it into the cache on a core of its own, and the thread then loads it (a warm start pays only forks)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from triton import knobs
from triton.runtime._async_compile import AsyncCompileMode
from triton.runtime.jit import JITFunction

MAX_THREADS = 32
CHILD_TIMEOUT_S = 120.0  # a forked compile stuck at a lock it inherited: the thread compiles the kernel itself


@dataclass
class DryRun:
    futures: list[Future] = field(default_factory=list)  # one per kernel
    deferred: int = 0  # choices left to the real run: they need kernels that run (worker/linear_plan.py)


_active: DryRun | None = None


def dry_run() -> DryRun | None:
    """The compile-only run in progress, if any: nothing runs in it, so nothing may be timed."""
    return _active


class _Pool(ThreadPoolExecutor):
    """Threads that compile and load kernels for the current GPU, keeping each one's future."""

    def __init__(self, dry: DryRun, fork: bool) -> None:
        super().__init__(max_workers=min(MAX_THREADS, len(os.sched_getaffinity(0))), thread_name_prefix="compile")
        self.dry, self.fork = dry, fork

    def submit(self, fn: Callable[[], object], /, *args, **kwargs) -> Future:  # called by the launching thread
        child = fork_compile(fn) if self.fork else None
        future = super().submit(_compile_and_load, torch.cuda.current_device(), fn, child)
        self.dry.futures.append(future)
        return future


def fork_compile(compile_kernel: Callable[[], object]) -> int | None:
    """A child process that runs compile_kernel (it writes Triton's disk cache; no CUDA) and exits; its pid."""
    with warnings.catch_warnings():  # of a fork beside threads: the child only compiles, and wait_child ends a hung one
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            pid = os.fork()
        except OSError:
            return None
    if pid == 0:
        signal.alarm(int(CHILD_TIMEOUT_S))  # a hung child ends even if its parent has gone
        try:
            compile_kernel()  # should it fail, the parent's thread compiles the kernel again and raises
        finally:
            os._exit(0)  # no atexit handlers, no flush of the parent's buffers, no return into its loop
    return pid


def wait_child(pid: int, timeout: float = CHILD_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.005)


def _compile_and_load(device: int, compile_kernel: Callable[[], object], child: int | None) -> object:
    if child is not None:
        wait_child(child)  # whatever it did, the compile below finds the kernel in the cache or makes it
    torch.cuda.set_device(device)  # a thread's own: the module loads on the engine's GPU
    kernel = compile_kernel()
    kernel._init_handles()  # what a first launch does: build the launcher, load the module
    return kernel


@contextlib.contextmanager
def compile_only(progress: bool = False) -> Iterator[DryRun]:
    """Launches inside only compile and load their kernels, in parallel; on exit, waits for them all (a bar with
    progress). A kernel that fails is left to its real launch, which raises as it would have."""
    global _active
    if _active is not None:
        raise RuntimeError("compile_only() is already active: a dry run cannot hold another")
    launch, do_compile, _active = JITFunction.run, JITFunction._do_compile, DryRun()

    def compile_instead_of_run(self: JITFunction, *args, grid, warmup: bool, **kwargs) -> object:
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    def compile_and_keep(self: JITFunction, key, signature, device, *args) -> object:
        kernel = do_compile(self, key, signature, device, *args)
        if kernel is not None:  # Triton 3.6 keeps it only once compiled: each launch until then would hash it again
            self.device_caches[device][0].setdefault(key, kernel)
        return kernel

    JITFunction.run, JITFunction._do_compile = compile_instead_of_run, compile_and_keep
    try:
        marker = os.path.join(knobs.cache.dir, "pico-vllm-compiled")  # gone with the cache it stands in
        with _Pool(_active, fork=not os.path.exists(marker)) as pool, AsyncCompileMode(pool, ignore_errors=True):
            yield pool.dry
            for _ in tqdm(
                as_completed(pool.dry.futures),
                total=len(pool.dry.futures),
                unit="kernel",
                desc=f"Compiling {len(pool.dry.futures)} Triton kernels",
                disable=not progress,
            ):
                pass
        os.makedirs(knobs.cache.dir, exist_ok=True)
        open(marker, "a").close()
    finally:
        JITFunction.run, JITFunction._do_compile, _active = launch, do_compile, None
