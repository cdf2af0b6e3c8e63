"""Socket addresses: ipc in a fresh private directory by default, TCP on loopback only when asked."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass

from protocol.shared_masks import masks_path


@dataclass(slots=True)
class Addresses:
    engine: str  # scheduler ROUTER: frontends (DEALER) send requests, receive TokenBatches
    results: str  # scheduler PULL: every worker rank pushes Ready / StepResult / WorkerError
    plans: list[str]  # one scheduler PUSH per worker rank
    ipc_dir: str | None = None  # removed at shutdown

    def to_dict(self) -> dict:
        return asdict(self)


def make_addresses(tp_size: int, engine: str | None = None, master: tuple[str, int] | None = None) -> Addresses:
    """Fresh 0700 ipc directory for the internal sockets; `engine` may be given (ipc:// or tcp://). With `master`
    (node 0's IP and rendezvous port: workers on other hosts), results and plans are TCP on the ports after it."""
    ipc_dir = tempfile.mkdtemp(prefix="pico-vllm-")  # mode 0700
    engine = check_engine_address(engine) if engine else f"ipc://{ipc_dir}/engine"
    if master is None:
        results, plans = f"ipc://{ipc_dir}/results", [f"ipc://{ipc_dir}/plan{r}" for r in range(tp_size)]
    else:
        host, port = master
        results, plans = f"tcp://{host}:{port + 1}", [f"tcp://{host}:{port + 2 + r}" for r in range(tp_size)]
    return Addresses(engine=engine, results=results, plans=plans, ipc_dir=ipc_dir)


def check_engine_address(addr: str) -> str:
    """Accept ipc://PATH or tcp://HOST:PORT; a bare tcp://:PORT or tcp://*:PORT binds loopback only."""
    if addr.startswith("ipc://") and len(addr) > len("ipc://"):
        return addr
    if addr.startswith("tcp://"):
        host, sep, port = addr[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"engine address {addr!r} lacks a port: use tcp://127.0.0.1:PORT")
        return f"tcp://{host if host not in ('', '*') else '127.0.0.1'}:{port}"
    raise ValueError(f"engine address {addr!r} is not ipc://PATH or tcp://HOST:PORT")


def remove_ipc_dir(addresses: Addresses) -> None:
    if addresses.ipc_dir:
        shutil.rmtree(addresses.ipc_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(masks_path(addresses.ipc_dir))
