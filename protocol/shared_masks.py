"""Grammar masks in shared memory: the scheduler fills a step's token bitmasks into a tmpfs file that every worker rank
maps, so a megabyte a step (64 rows) is neither packed, sent nor copied; the GrammarMask message says they are ready."""

from __future__ import annotations

import mmap
import os

import numpy as np

SLOTS = 2  # by step parity: a rank may still copy step N's mask while the scheduler fills step N + 1's
SHM_DIR = "/dev/shm"  # tmpfs: CUDA page-locks memory-backed pages, not a disk file's


class SharedMasks:
    """SLOTS x max_rows x ceil(vocab_size / 32) int32 words; bit t % 32 of word t // 32 allows token t."""

    def __init__(self, path: str, max_rows: int, vocab_size: int, create: bool = False) -> None:
        words = -(-vocab_size // 32)
        size = SLOTS * max_rows * words * 4
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not with a SIGBUS at a later write
            self.slots = np.frombuffer(mmap.mmap(fd, size), dtype=np.int32).reshape(SLOTS, max_rows, words)
        finally:
            os.close(fd)

    def slot(self, step: int, rows: int) -> np.ndarray:
        """Step `step`'s first `rows` mask rows, [rows, words]: a view of the shared file."""
        return self.slots[step % SLOTS, :rows]


def masks_path(ipc_dir: str) -> str:
    """The engine's mask file, named after its ipc directory (removed with it): on tmpfs where there is one."""
    return os.path.join(SHM_DIR if os.path.isdir(SHM_DIR) else ipc_dir, os.path.basename(ipc_dir) + "-grammar-masks")
