"""Atomic, self-checking checkpoints of a training run.

A checkpoint file is the SHA-256 of its payload followed by the payload (a
torch-serialised dict). It is written to a temporary file, fsync'd, renamed
into place, and the directory is fsync'd: a crash leaves either the old file
or the new one. On load, a file whose digest does not match (a torn or
corrupted write) is skipped and the previous checkpoint is used.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import Any

import torch

_DIGEST_BYTES = 32
_NAME = re.compile(r"^checkpoint-(\d{9})\.pt$")
KEEP = 2


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """Where the checkpoint after `step` steps lives."""
    return Path(run_dir) / f"checkpoint-{step:09d}.pt"


def _fsync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any]) -> Path:
    """Write `state` atomically as the checkpoint after `step` steps; keep the newest KEEP."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path = checkpoint_path(run_dir, step)
    temporary = path.with_suffix(".pt.tmp")
    with open(temporary, "wb") as handle:
        handle.write(hashlib.sha256(payload).digest())
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(path.parent)
    for old in checkpoint_files(run_dir)[:-KEEP]:
        old.unlink(missing_ok=True)
    return path


def checkpoint_files(run_dir: Path) -> list[Path]:
    """Checkpoint files in the run directory, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(path for path in run_dir.iterdir() if _NAME.match(path.name))


def read_checkpoint(path: Path) -> dict[str, Any] | None:
    """The state in `path`, or None when the file is torn or corrupt."""
    data = Path(path).read_bytes()
    digest, payload = data[:_DIGEST_BYTES], data[_DIGEST_BYTES:]
    if len(digest) < _DIGEST_BYTES or hashlib.sha256(payload).digest() != digest:
        return None
    # On the CPU: a checkpoint of a driver that ran on its GPU resumes on any driver.
    return torch.load(io.BytesIO(payload), weights_only=False, map_location="cpu")


def latest_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint and its state, or None if there is none."""
    for path in reversed(checkpoint_files(run_dir)):
        state = read_checkpoint(path)
        if state is not None:
            return path, state
    return None
