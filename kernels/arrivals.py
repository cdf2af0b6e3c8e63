"""Arrival counters: the last program to finish its part of a result combines the parts, instead of a second
kernel. One int32 buffer per device serves every call and replay (one stream): the last arriver resets each counter
to zero. It grows only on an eager call; a grown-out buffer stays alive for the graphs on it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_arrivals: dict[torch.device, torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []


def arrival_counters(device: torch.device, size: int, kernel: str) -> torch.Tensor:
    """The device's zeroed int32 counters, at least size of them; kernel names the caller in the error."""
    counters = _arrivals.get(device)
    if counters is not None and counters.numel() >= size:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        have = 0 if counters is None else counters.numel()
        raise RuntimeError(
            f"{kernel} needs {size} arrival counters on {device} but has {have}, and a CUDA graph "
            "is being captured: make the same call eagerly before capturing it"
        )
    if counters is not None:
        _outgrown.append(counters)
    _arrivals[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return _arrivals[device]


@triton.jit
def last_to_arrive(counter, count):
    """Whether this program is the last of count to arrive on counter; the last then reads (.cg) what others stored."""
    # The barrier puts every thread's stores before the one thread's release; acq_rel acquires the others'.
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == count - 1
    if last:
        tl.store(counter, 0)  # all count have arrived: zero again for the next call (or replay)
    return last
