"""Arrival counters: the last program of a kernel to finish its part of a result combines the parts, instead of
a second kernel.

One int32 buffer per device, shared by every kernel that counts. All counters are zero between calls (the last
arriver on each resets it), so one buffer serves every call and graph replay, given that calls on a device run
one at a time (one stream). It grows only on an eager call: a capture would bake in the allocation, so it fails
instead (warm each size up eagerly before capturing it). A grown-out buffer stays alive for the graphs on it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_arrivals: dict[torch.device, torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []


def arrival_counters(device: torch.device, size: int, kernel: str) -> torch.Tensor:
    """The device's zeroed int32 counters, at least size of them (grown, never shrunk, outside graph capture);
    kernel names the caller in the error."""
    counters = _arrivals.get(device)
    if counters is not None and counters.numel() >= size:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        have = 0 if counters is None else counters.numel()
        raise RuntimeError(f"{kernel} needs {size} arrival counters on {device} but has {have}, and a CUDA graph "
                           "is being captured: make the same call eagerly before capturing it")
    if counters is not None:
        _outgrown.append(counters)
    _arrivals[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return _arrivals[device]


@triton.jit
def last_to_arrive(counter, count):
    """Whether this program is the last of count to arrive on counter; the last one may then read what the
    others stored before arriving (with .cg loads: an L1 line filled earlier on this SM could be stale)."""
    # Every thread's stores come before the one thread's release (a scalar atomic runs on one thread and
    # broadcasts its result through shared memory behind a barrier, which orders the loads after); acq_rel also
    # acquires what the earlier arrivers released.
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == count - 1
    if last:
        tl.store(counter, 0)  # all count have arrived: zero again for the next call (or replay)
    return last
