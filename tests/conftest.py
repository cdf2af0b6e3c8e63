"""Shared fixtures. Kernels run under Triton's interpreter when there is no GPU."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
from checkpoints import make_checkpoint  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The default tiny checkpoint: tied embeddings, 4 query heads over 2 KV heads, head_dim 16."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"))
