"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start once the kernel before
calls gdc_launch_dependents(), and do the work that does not depend on it (a GEMV's first weight tile) before it
waits (gdc_wait()). Only the kernels that wait take it. PICO_VLLM_PDL=0 turns it off."""

from __future__ import annotations

import functools
import os

import torch

ENV = "PICO_VLLM_PDL"


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get(ENV) != "0" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """The launch option of a kernel that waits with gdc_wait before its first dependent load."""
    return {"launch_pdl": True} if pdl_enabled(device) else {}
