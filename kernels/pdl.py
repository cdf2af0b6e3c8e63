"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel
before it finishes, and do the work that does not depend on it (a GEMV's first weight tile) before it waits
(`tl.extra.cuda.gdc_wait()`). The kernel before lets it start early by `gdc_launch_dependents()`; a kernel
launched without it waits for the one before as usual, so only the kernels that wait take it. It pays most on
the batch-1 chain of GEMVs, each bound by its weights' loads. PICO_VLLM_PDL=0 turns it off.
"""
from __future__ import annotations

import functools
import os

import torch

ENV = "PICO_VLLM_PDL"


@functools.lru_cache(maxsize=None)
def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on this device use it: CUDA of compute capability 9 or more, unless turned off."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """The launch option of a kernel that waits with gdc_wait before its first dependent load."""
    return {"launch_pdl": True} if pdl_enabled(device) else {}
