"""Kernel choices timed on this machine, kept on disk so that a restart skips the timing.

linear() times cuBLAS against Triton GEMVs per shape at start-up (about a second for a 1.5B model's
graphs); like Triton's own kernel cache, the picks are kept in one JSON file under the cache directory
($PICO_VLLM_CACHE, else ~/.cache/pico-vllm). An entry is valid only for the GPU, torch, Triton and kernel
source that timed it: the key names all four, so an upgrade or an edited kernel is timed afresh.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from protocol.config import cache_root

log = logging.getLogger("pico_vllm.kernels")
FILE_NAME = "kernel-choices-v1.json"


def cache_file() -> Path:
    return cache_root() / FILE_NAME


@functools.lru_cache(maxsize=None)
def source_hash(path: str) -> str:
    """A short hash of a kernel's source file: an edit invalidates the choices timed with the old code."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def load_choices() -> dict[str, object]:
    """Every kept choice by key; empty when the file is missing or unreadable (then each is timed again)."""
    try:
        data = json.loads(cache_file().read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the kernel choice cache %s (%s): its shapes are timed again", cache_file(), e)
        return {}
    return data if isinstance(data, dict) else {}


def save_choice(key: str, value: object) -> None:
    """Add one choice: read, merge, write a temporary sibling, rename (a reader never sees half a file).

    Two processes saving at once may drop each other's new entry, which is then timed again next start.
    """
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**load_choices(), key: value}
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    except OSError as e:  # a read-only home must not stop the engine: the choice just is not kept
        log.warning("could not keep a kernel choice in %s: %s", path, e)
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not keep a kernel choice in %s: %s", path, e)
        Path(tmp).unlink(missing_ok=True)
