"""Starts the scheduler and worker processes, watches them, and stops them leaving nothing behind. Each child is
`python -m scheduler|worker` reading its arguments as msgpack on stdin: the caller's `__main__` is never re-imported."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import zmq

from frontend.model_resolution import resolve_config
from frontend.tokenizer import has_tokenizer_files, load_tokenizer, tokenizer_dir
from protocol.addresses import Addresses, make_addresses, remove_ipc_dir
from protocol.codec import encode
from protocol.config import EngineConfig, cache_root, pack_child_args
from protocol.messages import Shutdown

log = logging.getLogger("pico_vllm.launcher")
ROOT = Path(__file__).resolve().parents[1]
# NVLink multicast can take a shared host's GPUs down for a day: keep it off in every child.
_CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def start_child(module: str, args: bytes) -> subprocess.Popen:
    """`python -m module` with our packages first on its path (-P: not the caller's directory)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **_CHILD_ENV, "PYTHONPATH": path}
    if env.pop("PYTHONDONTWRITEBYTECODE", None):  # see cached_bytecode
        env.setdefault("PYTHONPYCACHEPREFIX", str(cache_root() / "pycache"))
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    proc = subprocess.Popen([sys.executable, *safe_path, "-m", module], stdin=subprocess.PIPE, env=env)
    with contextlib.suppress(BrokenPipeError):  # it died at once: the watcher reports its exit code
        proc.stdin.write(args)
        proc.stdin.close()
    return proc


@contextlib.contextmanager
def cached_bytecode() -> Iterator[None]:
    """Imports inside keep their bytecode under our cache (never beside the installation's files) when this interpreter
    writes none: images that set PYTHONDONTWRITEBYTECODE and ship no .pyc make torch compile at every start."""
    if not sys.dont_write_bytecode:
        yield
        return
    prefix = sys.pycache_prefix
    sys.dont_write_bytecode, sys.pycache_prefix = False, prefix or str(cache_root() / "pycache")
    try:
        yield
    finally:
        sys.dont_write_bytecode, sys.pycache_prefix = True, prefix


class EngineProcesses:
    """The scheduler and one worker per rank: started together, watched, stopped together."""

    def __init__(self, config: EngineConfig, engine_address: str | None = None) -> None:
        config.tokenizer_dir = tokenizer_dir(config.model, config.model_path)  # a path: the frontend loads it later
        self.config = config
        master = (config.master_addr, config.master_port) if config.nnodes > 1 else None
        self.addresses: Addresses = make_addresses(config.tensor_parallel_size, engine_address, master)
        self.owner = os.urandom(16)  # the ZeroMQ identity of the one frontend whose Shutdown the engine takes
        self.dead_reason: str | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self._stopping = False
        self.exited = threading.Event()  # set when any child exits
        self._lock = threading.Lock()
        self._on_death: list[Callable[[str], None]] = []

    def start(self) -> None:
        """The scheduler (on node 0) and this node's worker ranks."""
        addresses = self.addresses.to_dict()
        if self.config.node_rank == 0:
            self.procs["scheduler"] = start_child(
                "scheduler", pack_child_args(self.config, addresses, owner=self.owner)
            )
        for rank in self.config.local_ranks:
            self.procs[f"worker{rank}"] = start_child("worker", pack_child_args(self.config, addresses, rank=rank))
        for role, proc in self.procs.items():
            log.info("%s pid=%d", role, proc.pid)
            threading.Thread(target=self._watch, args=(role, proc), name=f"watch-{role}", daemon=True).start()

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call back (from a watcher thread) with the reason when a child dies unexpectedly."""
        self._on_death.append(callback)
        if self.dead_reason is not None:
            callback(self.dead_reason)

    def _watch(self, role: str, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self.exited.set()
        with self._lock:  # exit 0 is a stop that was asked for (a Shutdown the engine accepted), not a death
            if self._stopping or self.dead_reason is not None or code == 0:
                return
            self.dead_reason = f"engine process {role} (pid {proc.pid}) exited with code {code}"
        log.error("%s", self.dead_reason)
        for callback in self._on_death:
            callback(self.dead_reason)

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and all(p.poll() is None for p in self.procs.values())

    def shutdown(self, timeout: float = 5.0) -> None:
        """Wait for the children, then terminate, then kill (no wait after a death: a supervisor may be waiting)."""
        with self._lock:
            self._stopping = True
        self._wait_all(0.0 if self.dead_reason else timeout)
        for end in ("terminate", "kill"):
            for proc in self.procs.values():
                if proc.poll() is None:
                    getattr(proc, end)()
            self._wait_all(2.0)
        remove_ipc_dir(self.addresses)

    def _wait_all(self, timeout: float) -> None:
        """Wait for every child within one shared deadline (not `timeout` each)."""
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))


def run_node(config: EngineConfig) -> int:
    """Node 1.. of tensor parallel over hosts: this node's workers, until node 0's scheduler stops them (0), one
    dies (1), or SIGINT/SIGTERM (0)."""
    procs = EngineProcesses(resolve_config(config))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    procs.start()
    log.info(
        "node %d: ranks %s joining %s:%d",
        config.node_rank,
        list(config.local_ranks),
        config.master_addr,
        config.master_port,
    )
    while any(p.poll() is None for p in procs.procs.values()) and not stop.wait(0.5):
        pass
    procs.shutdown(0.0)  # it sets _stopping first: from then on no exit counts as a death
    return 0 if procs.dead_reason is None else 1


def run_headless(config: EngineConfig, address: str) -> int:
    """Serve the engine at `address` without HTTP until SIGINT/SIGTERM (0) or a child's death (1)."""
    procs = EngineProcesses(resolve_config(config), address)
    if config.tokenizer_dir is not None and not has_tokenizer_files(config.tokenizer_dir):
        load_tokenizer(config.model, config.model_path)  # builds the offline files the grammars read, once a machine
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    procs.start()
    log.info("engine listening at %s", procs.addresses.engine)
    while not stop.is_set() and not procs.exited.wait(0.5):
        pass
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.IDENTITY, procs.owner)
        sock.connect(procs.addresses.engine)
        sock.send(encode(Shutdown()))
    procs.shutdown()  # it sets _stopping first: from then on no exit counts as a death
    return 0 if procs.dead_reason is None else 1
