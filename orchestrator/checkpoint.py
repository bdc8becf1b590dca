"""Atomic, self-checking checkpoints of a training run.

A checkpoint file is the SHA-256 of its payload followed by the payload (a
torch-serialised dict). It is written to a temporary file, fsync'd, renamed
into place, and the directory is fsync'd: a crash leaves either the old file
or the new one. On load, a file whose digest does not match (a torn or
corrupted write) is skipped and the previous checkpoint is used.

A checkpoint is the run's working state, for the run's operator: it holds
no secret (no key, generator state or drawn sample; see docs/threat-model.md).
Its name carries the run's id, so runs that share a directory keep and prune
their own checkpoints only. A resume reads only this format's version
(`check_checkpoint_version`) of the same run (`check_same_run`, by the
binding of ``orchestrator.binding``).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import Any

import torch

from orchestrator.binding import binding_differences
from orchestrator.errors import UsageError

# 2: no secret (no noise entropy, sampler state or drawn sample), a run id, and the run's binding.
CHECKPOINT_VERSION = 2
_DIGEST_BYTES = 32
# checkpoint-<run id>-<step>.pt; the names of the first format had no run id.
_NAME = re.compile(r"^checkpoint-(?:(?P<run_id>[0-9a-f]{16})-)?(?P<step>\d{9})\.pt$")
KEEP = 2


def checkpoint_path(run_dir: Path, run_id: str, step: int) -> Path:
    """Where run `run_id`'s checkpoint after `step` steps lives."""
    if not re.fullmatch(r"[0-9a-f]{16}", run_id):
        raise ValueError(f"a run id is 16 lowercase hex digits (got {run_id!r})")
    return Path(run_dir) / f"checkpoint-{run_id}-{step:09d}.pt"


def checkpoint_step(path: Path) -> int:
    """The step count after which the checkpoint at `path` was written, from its name."""
    name = _NAME.match(Path(path).name)
    if name is None:
        raise ValueError(f"{str(path)!r} is not named as a checkpoint (checkpoint-<run id>-<step>.pt)")
    return int(name["step"])


def _fsync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def save_checkpoint(run_dir: Path, run_id: str, step: int, state: dict[str, Any]) -> Path:
    """Write `state` atomically as run `run_id`'s checkpoint after `step` steps; keep that run's newest KEEP."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path = checkpoint_path(run_dir, run_id, step)
    temporary = path.with_suffix(".pt.tmp")
    with open(temporary, "wb") as handle:
        handle.write(hashlib.sha256(payload).digest())
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(path.parent)
    for old in checkpoint_files(run_dir, run_id)[:-KEEP]:
        old.unlink(missing_ok=True)
    return path


def checkpoint_files(run_dir: Path, run_id: str | None = None) -> list[Path]:
    """Run `run_id`'s checkpoint files in the run directory, oldest first (every run's, by time, when None)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(path, _NAME.match(path.name)) for path in run_dir.iterdir()]
    if run_id is not None:
        return sorted(path for path, name in found if name and name["run_id"] == run_id)
    # Steps of different runs do not compare: the newest is the one written last.
    return [path for _, _, path in sorted((path.stat().st_mtime_ns, int(name["step"]), path)
                                          for path, name in found if name)]


def read_checkpoint(path: Path) -> dict[str, Any] | None:
    """The state in `path`, or None when the file is torn or corrupt."""
    data = Path(path).read_bytes()
    digest, payload = data[:_DIGEST_BYTES], data[_DIGEST_BYTES:]
    if len(digest) < _DIGEST_BYTES or hashlib.sha256(payload).digest() != digest:
        return None
    # On the CPU: a checkpoint of a driver that ran on its GPU resumes on any driver.
    return torch.load(io.BytesIO(payload), weights_only=False, map_location="cpu")


def latest_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint of any run in `run_dir` (the last written) and its state, or None."""
    for path in reversed(checkpoint_files(run_dir)):
        state = read_checkpoint(path)
        if state is not None:
            return path, state
    return None


def check_checkpoint_version(state: dict, path: Path | None = None) -> None:
    """Refuse a checkpoint of another format: those of version 1 held the run's secrets and no binding to its data.

    A version 1 checkpoint kept the noise's root entropy and the sampler's
    state, from which every step's noise and sample can be recomputed, and
    nothing to check that a resume is the same run. It is refused rather
    than resumed without them: the run cannot be shown to continue on the
    same data, and the file itself should not be kept.
    """
    version = state.get("version")
    if version == CHECKPOINT_VERSION:
        return
    where = f" {str(path)!r}" if path is not None else ""
    if version == 1:
        raise UsageError(
            f"checkpoint{where} is of version 1, which holds the run's noise and sampling secrets and no binding "
            "to its data, and cannot be resumed: delete it (anyone who reads it can recompute every step's noise "
            "and sample) and start a new run: dpfleet train --config FILE --run-dir NEW_DIR"
        )
    raise UsageError(f"checkpoint{where} is of version {version!r}; this dpfleet reads version {CHECKPOINT_VERSION} "
                     "only: resume with the dpfleet that wrote it, or start a new run")


def check_same_run(state: dict, binding: dict, run_dir: Path) -> None:
    """Refuse a checkpoint of another format, or of another run than the one that `binding` describes."""
    check_checkpoint_version(state)
    differences = binding_differences(state["binding"], binding)
    if differences:
        raise UsageError(
            f"the checkpoint in {str(run_dir)!r} is not of this run: " + "; ".join(differences)
            + ". A resume continues the same run on the same data under the same reservation; to train "
            "with this configuration or data, start a new run: dpfleet train --config FILE --run-dir NEW_DIR"
        )
