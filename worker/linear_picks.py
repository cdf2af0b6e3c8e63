"""The linear plan's picks shipped for known GPUs (linear_picks.json beside this file, written by `python -m
bench.linear_picks` on each GPU): worker/linear_plan.py looks a shape up here first and times it at start-up only
when this GPU or shape is missing. PICO_VLLM_SHIPPED_PICKS=0 ignores the file (every shape is timed here)."""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

PATH = Path(__file__).with_name("linear_picks.json")
FORMAT = 1  # the file's layout: {"format": 1, "gpus": {device name: {pick key: pick}}}
ENV = "PICO_VLLM_SHIPPED_PICKS"
log = logging.getLogger("pico_vllm.kernels")


def read(path: Path) -> dict:
    """The file's content; an empty one (no GPU) when it is missing, unreadable or of another format."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this code reads {FORMAT}")
    except FileNotFoundError:
        data = {}
    except (OSError, ValueError, AttributeError) as e:
        log.warning("ignoring the shipped linear picks %s (%s): their shapes are timed here", path, e)
        data = {}
    return data or {"format": FORMAT, "gpus": {}}


@functools.cache
def shipped(gpu: str) -> dict[str, object]:
    """This GPU's picks by key ("gemv fold ..." a GEMV config or None, "gemm rows w ..." µs by row count)."""
    return {} if os.environ.get(ENV, "1") == "0" else read(PATH)["gpus"].get(gpu, {})
