"""Batches planned ahead: a window of steps' samples gathered from Parquet in one sequential pass by Ray Data.

Reading a Poisson sample row by row costs one row group's decoding per
sampled row, which is ruinous when row groups are large (pyarrow's and
Spark's defaults). Since each step's sample is a pure function of the run's
secret key, the next K steps can be drawn before any is run. The window's
(step, worker, position, row) entries are sorted by row (`window_plan`), and
one Ray Data pass (`gather_window`) streams every file once, in order,
decoding only the row groups that hold a planned row, each once per window
and in record batches of ``READ_ROWS`` rows, so no task holds a whole row
group. It writes each (step, worker) batch as Arrow IPC fragments into a
folder that only the run's user can enter (`private_window_folder`); the
worker reads its batch of a step from there (`read_planned_batch`). Neither
the driver nor the gather keeps more than a window's rows of one file, and
a worker holds only its batch and the one read ahead.

Who is in which step is as secret as the noise: the plan lives in memory and
in the Ray object store, the folder is 0700 and is removed as soon as its
window has run (and when the run ends), and nothing about it is logged.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as pa_ipc
import pyarrow.parquet as pq

from workers.lazy import LazyModule
from workers.sources import PARQUET_SUFFIXES, ParquetSource, _check_schema, _files_at, _feature_tensor, \
    _label_tensor, _table_to_numpy

torch = LazyModule("torch")

# Rows per record batch that the gather decodes at a time: its memory is bounded by this, not by the row group.
READ_ROWS = 4096
_POSITION = "__position"


@dataclass(frozen=True)
class WindowPlan:
    """Every sampled example of a window, sorted by ``rows``: which step and worker it goes to, at which position."""

    rows: np.ndarray
    steps: np.ndarray
    workers: np.ndarray
    positions: np.ndarray


def window_plan(shares: Mapping[int, Sequence[np.ndarray]]) -> WindowPlan:
    """The window's plan from each step's worker shares ({step: [rows of worker 0, rows of worker 1, ...]}).

    An example sampled in several steps appears once per step; a stable sort
    keeps each share's order, which ``positions`` records.
    """
    rows, steps, workers, positions = [], [], [], []
    for step, step_shares in shares.items():
        for worker, share in enumerate(step_shares):
            share = np.asarray(share, dtype=np.int64)
            rows.append(share)
            steps.append(np.full(len(share), step, dtype=np.int64))
            workers.append(np.full(len(share), worker, dtype=np.int64))
            positions.append(np.arange(len(share), dtype=np.int64))
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return WindowPlan(empty, empty, empty, empty)
    rows_all = np.concatenate(rows)
    order = np.argsort(rows_all, kind="stable")
    return WindowPlan(rows_all[order], np.concatenate(steps)[order], np.concatenate(workers)[order],
                      np.concatenate(positions)[order])


def private_window_folder() -> str:
    """A new folder that only this user can enter (mode 0700), for a window's gathered batches."""
    return tempfile.mkdtemp(prefix="dpfleet-window-")


def remove_window_folder(folder: str) -> None:
    """Delete a window's folder and every batch in it (nothing to do when it is already gone)."""
    shutil.rmtree(folder, ignore_errors=True)


def _fragment_path(folder: str, step: int, worker: int, file_index: int) -> str:
    return os.path.join(folder, f"step-{step:09d}-worker-{worker:05d}-file-{file_index:06d}.arrow")


def file_row_counts(spec: Mapping, split: str) -> tuple[list[str], np.ndarray]:
    """The split's Parquet paths and each file's row count, from the footers (each dropped once counted)."""
    _, paths = _files_at(spec[split], PARQUET_SUFFIXES)
    return paths, np.asarray([pq.ParquetFile(path).metadata.num_rows for path in paths], dtype=np.int64)


def gather_file(path: str, file_index: int, file_start: int, plan: WindowPlan, columns: list[str], label: str,
                folder: str) -> list[int]:
    """Write the planned rows of one file into `folder`, one fragment per (step, worker); the row groups read.

    `plan` holds only this file's entries (rows are global). The row groups
    holding a planned row are decoded in file order, each once, in record
    batches of READ_ROWS rows.
    """
    parquet = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    metadata = parquet.metadata
    group_sizes = np.asarray([metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)])
    group_starts = file_start + np.concatenate([[0], np.cumsum(group_sizes)])
    groups = np.unique(np.searchsorted(group_starts, plan.rows, side="right") - 1)
    taken, entry = [], 0
    for group in groups.tolist():
        batch_start = int(group_starts[group])
        for batch in parquet.iter_batches(batch_size=READ_ROWS, row_groups=[group], columns=[*columns, label],
                                          use_threads=False):
            batch_stop = batch_start + batch.num_rows
            stop = int(np.searchsorted(plan.rows, batch_stop, side="left"))
            if stop > entry:
                taken.append((entry, batch.take(pa.array(plan.rows[entry:stop] - batch_start))))
                entry = stop
            batch_start = batch_stop
    if taken:
        table = pa.Table.from_batches([batch for _, batch in taken])
        _write_fragments(table, plan, file_index, folder)
    return groups.tolist()


def _write_fragments(table: pa.Table, plan: WindowPlan, file_index: int, folder: str) -> None:
    """Split the gathered rows (in plan order) by (step, worker) and write each part with its positions."""
    keys = plan.steps * (plan.workers.max() + 1) + plan.workers
    for key in np.unique(keys).tolist():
        chosen = np.flatnonzero(keys == key)
        step, worker = int(plan.steps[chosen[0]]), int(plan.workers[chosen[0]])
        part = table.take(pa.array(chosen)).append_column(_POSITION, pa.array(plan.positions[chosen]))
        descriptor = os.open(_fragment_path(folder, step, worker, file_index), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                             0o600)
        with os.fdopen(descriptor, "wb") as handle, pa_ipc.new_file(handle, part.schema) as writer:
            writer.write_table(part)


def _gather_files(items: dict[str, np.ndarray], columns: list[str], label: str, folder: str) -> dict:
    """Ray Data's map over the files: gather each file's planned rows; answer only which row groups were read."""
    read_files, read_groups = [], []
    for index in range(len(items["path"])):
        plan = WindowPlan(*(np.asarray(items[name][index], dtype=np.int64)
                            for name in ("rows", "steps", "workers", "positions")))
        groups = gather_file(str(items["path"][index]), int(items["file"][index]), int(items["start"][index]), plan,
                             columns, label, folder)
        read_files.extend([int(items["file"][index])] * len(groups))
        read_groups.extend(groups)
    return {"file": np.asarray(read_files, dtype=np.int64), "group": np.asarray(read_groups, dtype=np.int64)}


def gather_window(spec: Mapping, shares: Mapping[int, Sequence[np.ndarray]], folder: str,
                  remote_args: Mapping | None = None) -> list[tuple[int, int]]:
    """Gather the window's batches (`shares`, as for `window_plan`) into `folder` with one Ray Data pass.

    One Ray Data task per file with planned rows, asking for no CPU;
    `remote_args` are further Ray options for those tasks (a scheduling strategy that keeps them on the
    node that holds the folder). Returns the (file, row group) pairs read,
    each once; the rows themselves never come back.
    """
    import ray.data  # only a planned run needs Ray Data (and pandas)

    paths, counts = file_row_counts(spec, "train")
    columns, _ = _check_schema(spec, pq.ParquetFile(paths[0]).schema_arrow, paths[0])
    label = spec.get("label", "label")
    plan = window_plan(shares)
    starts = np.concatenate([[0], np.cumsum(counts)])
    cuts = np.searchsorted(plan.rows, starts)
    items = [{"path": paths[index], "file": index, "start": int(starts[index]),
              "rows": plan.rows[cuts[index]:cuts[index + 1]], "steps": plan.steps[cuts[index]:cuts[index + 1]],
              "workers": plan.workers[cuts[index]:cuts[index + 1]],
              "positions": plan.positions[cuts[index]:cuts[index + 1]]}
             for index in range(len(paths)) if cuts[index + 1] > cuts[index]]
    if not items:
        return []
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    read = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _gather_files, batch_size=1, batch_format="numpy",
        # No CPU of its own: the gradient workers may hold every CPU while the next window is gathered.
        fn_kwargs={"columns": columns, "label": label, "folder": folder}, num_cpus=0, **dict(remote_args or {}),
    ).take_all()
    return [(int(row["file"]), int(row["group"])) for row in read]


@dataclass(frozen=True)
class PlannedBatch:
    """Where a worker finds its share of a step: the window's folder, the step and the worker's number."""

    folder: str
    step: int
    worker: int


def read_planned_batch(batch: PlannedBatch, spec: Mapping) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(inputs, labels) of a worker's share of a step, in the order of its share; None for an empty share."""
    prefix = f"step-{batch.step:09d}-worker-{batch.worker:05d}-"
    names = sorted(name for name in os.listdir(batch.folder) if name.startswith(prefix))
    if not names:
        return None
    columns, _ = _check_schema(spec, _first_schema(spec), "the dataset")
    label = spec.get("label", "label")
    tables = []
    for name in names:
        with pa.memory_map(os.path.join(batch.folder, name)) as source:
            tables.append(pa_ipc.open_file(source).read_all())
    table = pa.concat_tables(tables)
    table = table.take(pa.array(np.argsort(table.column(_POSITION).to_numpy())))
    features, labels = _table_to_numpy(table, columns, label)
    return _feature_tensor(features.copy(), spec.get("shape")), _label_tensor(labels.copy())


def _first_schema(spec: Mapping) -> pa.Schema:
    _, paths = _files_at(spec["train"], PARQUET_SUFFIXES)
    return pq.read_schema(paths[0])


class PlannedBatchReader:
    """A worker's reader of its planned batches, with the next one read on a background thread (read-ahead 1).

    It holds at most two batches: the step's and the next one's.
    """

    def __init__(self, spec: Mapping) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.spec = spec
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="planned-batch")
        self._ahead = None

    def prefetch(self, batch: PlannedBatch) -> None:
        """Start reading `batch` (replacing any read ahead not yet taken)."""
        self._ahead = (batch, self._reader.submit(read_planned_batch, batch, self.spec))

    def read(self, batch: PlannedBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`batch`'s rows: those read ahead when it is the batch read ahead, else read now."""
        if self._ahead is not None and self._ahead[0] == batch:
            _, reading = self._ahead
            self._ahead = None
            return reading.result()
        return read_planned_batch(batch, self.spec)


def first_row(spec: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """The split's first example, streamed: decoding it never holds its whole row group."""
    _, paths = _files_at(spec["train"], PARQUET_SUFFIXES)
    parquet = pq.ParquetFile(paths[0], pre_buffer=False, buffer_size=1 << 20)
    columns, _ = _check_schema(spec, parquet.schema_arrow, paths[0])
    label = spec.get("label", "label")
    batch = next(parquet.iter_batches(batch_size=1, columns=[*columns, label], use_threads=False))
    features, labels = _table_to_numpy(pa.Table.from_batches([batch]).slice(0, 1), columns, label)
    return _feature_tensor(features.copy(), spec.get("shape")), _label_tensor(labels.copy())


class PlannedRunSource:
    """A planned run's training split on a worker: its size from the files' row counts, no row-group index held.

    Steps read from planned batches, so the worker keeps no per-row-group
    metadata (which grows with N). A read of no rows (the example's shape)
    streams the first example alone; any other read (a feature cache, the
    non-private train loss) opens a `ParquetSource` then and keeps it.
    """

    def __init__(self, spec: Mapping) -> None:
        self.spec = spec
        self.size = int(file_row_counts(spec, "train")[1].sum())
        self.source: ParquetSource | None = None
        self.no_rows = None

    def __len__(self) -> int:
        return self.size

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at ``indices`` through a Parquet source (opened for the first read of none alone)."""
        if not len(indices) and self.source is None:
            if self.no_rows is None:
                self.no_rows = first_row(self.spec)
            return self.no_rows[0][:0], self.no_rows[1][:0]
        if self.source is None:
            self.source = ParquetSource(self.spec, "train")
        return self.source.read(indices)
