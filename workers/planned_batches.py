"""Batches planned ahead: a window of steps' samples gathered from Parquet in one sequential pass by Ray Data.

Reading a Poisson sample row by row costs one row group's decoding per
sampled row, which is ruinous when row groups are large (pyarrow's and
Spark's defaults). Since each step's sample is a pure function of the run's
secret key, the next K steps can be drawn before any is run. The window's
(step, worker, position, row) entries are sorted by row (`window_plan`), and
one Ray Data pass (`gather_window`) streams the files once, in order,
decoding only the row groups that hold a planned row, each once per window
and in record batches of ``READ_ROWS`` rows, so no task holds a whole row
group. It writes each (step, worker) batch as one sealed file into a
folder that only the run's user can enter (`private_window_folder`); the
worker reads and opens its batch of a step from there (`PlannedBatchReader`),
reading the next step's ahead. `PlannedWindows` gathers window k + 1 on a
background thread while window k trains. The driver never holds the rows;
the gather holds one window's gathered rows, and a worker only its batch
and the one read ahead. Nor does a gradient worker parse a footer: the
files, their row counts and columns (`PlannedDataset`) are read once, by the
driver or by a task beside a silo's workers, since a footer's parsed
metadata grows with the number of row groups (about 2 kB a group: 0.3 GB
for a file of 2.5 million rows in `dpfleet data export`'s 16-row groups) and
the allocator keeps that memory in the process that parsed it.

Who is in which step is as secret as the noise. The plan lives in memory
and in the Ray object store; the folder is 0700 and is removed as soon as
its window has run (and when the run ends, however it ends short of a
kill). Mode 0700 keeps out other users only, not another Ray job of the
same user, nor anyone who finds a killed run's folder: so every file is
sealed under the run's key, which lives in memory only
(`workers.window_keys`), and every file of a run has the same size
(`share_capacity`), as has each window's plan in Ray Data; Ray Data logs
nothing of a window (`quiet_ray_data`). What a kill leaves is ciphertext of
a size set by public figures. A folder whose owner was killed is removed
when the next run starts on that node, planned or not
(`remove_stale_window_folders_on`): each folder's owner holds a flock on
its lock file, which the kernel drops with the process.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from workers.lazy import LazyModule
from workers.sources import PARQUET_SUFFIXES, ParquetSource, _check_schema, _feature_array, _feature_tensor, \
    _files_at, _label_array, _label_tensor, _table_to_numpy
from workers.window_keys import WindowKey, WindowSeal, open_file

torch = LazyModule("torch")

# Rows per record batch that the gather decodes at a time: its memory is bounded by this, not by the row group.
READ_ROWS = 4096


# The label every Ray node carries with its id: a task that selects it runs on that node and no other.
NODE_ID_LABEL = "ray.io/node-id"


def on_node(node_id: str) -> dict[str, str]:
    """The Ray label selector of the node `node_id` (a task's or a Ray Data map's ``label_selector``)."""
    return {NODE_ID_LABEL: node_id}


@dataclass(frozen=True, eq=False)
class PlannedDataset:
    """A Parquet training split as a planned run's workers and gathers know it, read from the footers once.

    ``paths`` are its files in order and ``row_counts`` their rows;
    ``columns`` and ``label`` name the feature and label columns, ``shape``
    each example's (the spec's, or None); ``no_rows`` are (features,
    labels) of no rows in the dtypes and widths that reads give, so that a
    worker knows an example's shape without reading one (labels [0] or,
    one per token, [0, T]). ``max_length`` is the spec's: list columns are
    cut and padded to it as they are gathered.
    """

    paths: tuple[str, ...]
    row_counts: tuple[int, ...]
    columns: tuple[str, ...]
    label: str
    shape: tuple[int, ...] | None
    no_rows: tuple[np.ndarray, np.ndarray]
    max_length: int | None = None

    @property
    def size(self) -> int:
        """How many rows the split holds."""
        return sum(self.row_counts)

    @property
    def row_bytes(self) -> int:
        """One example's bytes as a worker reads it (features and label)."""
        features, labels = self.no_rows
        return features.itemsize * int(np.prod(features.shape[1:])) + labels.itemsize * int(np.prod(labels.shape[1:]))

    def no_rows_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``no_rows`` as the tensors a read of no rows gives: features [0, *shape], labels [0] (or [0, T])."""
        return _feature_tensor(self.no_rows[0], self.shape), _label_tensor(self.no_rows[1])


def read_planned_dataset(spec: Mapping) -> PlannedDataset:
    """The training split of a Parquet `spec` as `PlannedDataset`, from its files' footers, read here.

    The columns are checked on the first file; its first example is
    streamed (its row group never held whole) for the widths and dtypes of
    ``no_rows``, whose values are dropped. Each footer is dropped once
    counted, but the memory its parsed metadata took stays with this
    process: a gradient worker never calls it. The driver does, and hands
    the result to its workers; a silo's worker calls
    `read_planned_dataset_beside`.
    """
    _, paths = _files_at(spec["train"], PARQUET_SUFFIXES)
    label = spec.get("label", "label")
    first = pq.ParquetFile(paths[0], pre_buffer=False, buffer_size=1 << 20)
    columns, _ = _check_schema(spec, first.schema_arrow, paths[0])
    batch = next(first.iter_batches(batch_size=1, columns=[*columns, label], use_threads=False))
    features, labels = _table_to_numpy(pa.Table.from_batches([batch]).slice(0, 1), columns, label,
                                       spec.get("max_length"))
    counts = [first.metadata.num_rows]
    del first
    counts += [pq.ParquetFile(path).metadata.num_rows for path in paths[1:]]
    shape = spec.get("shape")
    return PlannedDataset(tuple(paths), tuple(int(count) for count in counts), tuple(columns), label,
                          None if shape is None else tuple(shape),
                          (_feature_array(features)[:0].copy(), _label_array(labels)[:0].copy()),
                          spec.get("max_length"))


def read_planned_dataset_beside(spec: Mapping) -> PlannedDataset:
    """`read_planned_dataset` in a Ray task on this node: the parsed footers weigh on that task's process alone.

    For a silo's gradient worker, whose files only its node can read; it
    asks for no CPU, since the workers may hold every one.
    """
    import ray

    here = on_node(ray.get_runtime_context().get_node_id())
    return ray.get(ray.remote(read_planned_dataset).options(num_cpus=0, label_selector=here).remote(spec))


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


WINDOW_PREFIX = "dpfleet-window-"
_LOCK_SUFFIX = ".lock"
# The open lock file of each window folder this process owns: its flock says the folder is in use.
_held_locks: dict[str, int] = {}
_held_locks_guard = threading.Lock()


def private_window_folder(parent: str | None = None, owner: str = "") -> str:
    """A new folder that only this user can enter (mode 0700), for a window's gathered batches, owned by this process.

    Its name starts with WINDOW_PREFIX and `owner` (`remove_owned_window_folders`).
    Beside it (in `parent`, the temporary folder by default) lies its lock
    file, the folder's name + ".lock", on which this process holds an
    exclusive flock until `remove_window_folder`. The kernel drops the lock
    when the process dies, however it dies, which is how
    `remove_stale_window_folders` tells a killed run's folder from a live
    one. The lock is taken before the folder exists and dropped after it is
    gone, so a folder without a held lock is never in use.
    """
    while True:
        descriptor, lock_path = tempfile.mkstemp(prefix=WINDOW_PREFIX + owner, suffix=_LOCK_SUFFIX, dir=parent)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a sweep holds the new lock: it unlinks it, and we draw another name
            os.close(descriptor)
            continue
        # A sweep may have taken the new lock first and unlinked it (it saw a lock file nobody held): draw anew.
        if os.fstat(descriptor).st_nlink:
            folder = lock_path[:-len(_LOCK_SUFFIX)]
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:  # a stale folder of that name, without a lock
                os.unlink(lock_path)
            else:
                with _held_locks_guard:
                    _held_locks[folder] = descriptor
                return folder
        os.close(descriptor)


def remove_window_folder(folder: str) -> None:
    """Delete a window's folder and every batch in it, then its lock (nothing to do when it is already gone)."""
    shutil.rmtree(folder, ignore_errors=True)
    with _held_locks_guard:
        descriptor = _held_locks.pop(folder, None)
    if descriptor is not None:
        with suppress(FileNotFoundError):
            os.unlink(folder + _LOCK_SUFFIX)
        os.close(descriptor)


def remove_owned_window_folders(owner: str, parent: str | None = None) -> None:
    """Delete every window folder of `owner` in `parent` (the temporary folder by default), and its lock.

    By name, not by a record of them: an interrupt (Ctrl-C, SIGTERM) that
    lands between a folder's making and its recording leaves no folder.
    Only this process's own owners are named, so every folder is one it made.
    """
    for entry in os.scandir(parent or tempfile.gettempdir()):
        if entry.name.startswith(WINDOW_PREFIX + owner) and entry.name.endswith(_LOCK_SUFFIX):
            remove_window_folder(entry.path[:-len(_LOCK_SUFFIX)])


def remove_stale_window_folders(parent: str | None = None) -> list[str]:
    """Delete the window folders in `parent` (the temporary folder by default) whose owning process is gone.

    A folder is stale when nobody holds its lock: a non-blocking flock
    succeeds, so its owner was killed before it could clean up. A live
    run's folder, whose lock its owner holds, is never touched, nor is a
    folder without a lock file (one that no owner of this kind made). Only
    this user's lock files can be opened, so only their folders are
    removed. Returns the folders removed.
    """
    removed = []
    for entry in os.scandir(parent or tempfile.gettempdir()):
        if entry.name.startswith(WINDOW_PREFIX) and entry.name.endswith(_LOCK_SUFFIX):
            folder = entry.path[:-len(_LOCK_SUFFIX)]
            if _take_stale_lock(entry.path, folder):
                removed.append(folder)
    return removed


def remove_stale_window_folders_on(node_ids: Iterable[str]) -> None:
    """`remove_stale_window_folders` here and on each node of `node_ids`, by a task there that asks for no CPU.

    Every run calls it as it starts, planned or not, for the nodes its
    workers use: a killed run's sealed windows go at the next run on any of
    its nodes, not only at the next planned one. The task sweeps the
    temporary folder of that node's Ray workers, where their windows lie.
    """
    import ray

    remove_stale_window_folders()
    here = ray.get_runtime_context().get_node_id()
    sweep = ray.remote(remove_stale_window_folders)
    ray.get([sweep.options(num_cpus=0, label_selector=on_node(node)).remote() for node in set(node_ids) - {here}])


def _take_stale_lock(lock_path: str, folder: str) -> bool:
    """Remove `folder` and its lock file when nobody holds the lock; whether it did."""
    try:
        descriptor = os.open(lock_path, os.O_RDONLY)
    except OSError:  # gone meanwhile, or another user's
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its owner lives
        os.close(descriptor)
        return False
    try:
        # Unlinked meanwhile by another sweep (which removed the folder): nothing left to do.
        if not os.fstat(descriptor).st_nlink:
            return False
        shutil.rmtree(folder, ignore_errors=True)
        with suppress(FileNotFoundError):
            os.unlink(lock_path)
        return True
    finally:
        os.close(descriptor)


def _batch_path(folder: str, step: int, worker: int) -> str:
    return os.path.join(folder, f"step-{step:09d}-worker-{worker:05d}.sealed")


# Standard deviations of a share's size above its mean that a window file holds without growing.
CAPACITY_SIGMAS = 8


def share_capacity(expected_share: float) -> int:
    """The rows every window file holds, padded: a worker's expected share of a step plus 8 standard deviations.

    Every file of a run is this size, so neither a file, a folder nor the
    gather's input says how many examples a step sampled. A share of
    Poisson size with mean μ exceeds μ + 8√μ + 8 with probability below
    1e-14; a file that must hold more grows by whole capacities, which says
    only that this happened.
    """
    if not expected_share >= 0:
        raise ValueError(f"expected_share must be >= 0 rows (got {expected_share})")
    return int(np.ceil(expected_share + CAPACITY_SIGMAS * np.sqrt(expected_share) + CAPACITY_SIGMAS))


def _padded_length(rows: int, capacity: int) -> int:
    """`rows` rounded up to whole capacities, at least one."""
    return capacity * max(1, -(-rows // capacity))


def gather_file(path: str, file_start: int, rows: np.ndarray, columns: list[str], label: str) \
        -> tuple[list[pa.RecordBatch], list[int]]:
    """The planned rows of one file, in the order of `rows` (sorted, global), and the row groups read.

    The row groups holding a planned row are decoded in file order, each
    once, in record batches of READ_ROWS rows.
    """
    parquet = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    metadata = parquet.metadata
    group_sizes = np.asarray([metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)])
    group_starts = file_start + np.concatenate([[0], np.cumsum(group_sizes)])
    groups = np.unique(np.searchsorted(group_starts, rows, side="right") - 1)
    taken, entry = [], 0
    for group in groups.tolist():
        batch_start = int(group_starts[group])
        for batch in parquet.iter_batches(batch_size=READ_ROWS, row_groups=[group], columns=[*columns, label],
                                          use_threads=False):
            batch_stop = batch_start + batch.num_rows
            stop = int(np.searchsorted(rows, batch_stop, side="left"))
            if stop > entry:
                taken.append(batch.take(pa.array(rows[entry:stop] - batch_start)))
                entry = stop
            batch_start = batch_stop
    return taken, groups.tolist()


def write_step_batches(features: np.ndarray, labels: np.ndarray, plan: WindowPlan, folder: str, steps: range,
                       workers: int, capacity: int, seal: WindowSeal) -> None:
    """Write the gathered rows (`features`, `labels` as a read gives them, in plan order) as one sealed file per
    (step, worker) of the window, each in share order.

    Every (step, worker) has its file, an empty share too, and each holds
    its row count, features and labels padded with zeros to `capacity`
    rows (`share_capacity`), sealed by `seal` (`workers.window_keys`). The
    files are 0600, created anew (never overwritten). Labels may be one
    per example or one per token ([rows, T]).
    """
    keys = plan.steps * workers + plan.workers
    order = np.lexsort((plan.positions, keys))
    features, labels, keys = features[order], labels[order], keys[order]
    row_features = features.itemsize * features.shape[1]
    row_labels = labels.itemsize * int(np.prod(labels.shape[1:]))
    for step in steps:
        for worker in range(workers):
            start, stop = np.searchsorted(keys, [step * workers + worker, step * workers + worker + 1])
            rows = int(stop - start)
            slots = _padded_length(rows, capacity)
            plaintext = b"".join([rows.to_bytes(8, "little"), features[start:stop].tobytes(),
                                  bytes((slots - rows) * row_features), labels[start:stop].tobytes(),
                                  bytes((slots - rows) * row_labels)])
            descriptor = os.open(_batch_path(folder, step, worker), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(seal.seal(plaintext, step, worker))


def _gather_files(items: dict[str, np.ndarray], dataset: PlannedDataset, folder: str, steps: range, workers: int,
                  capacity: int, run: bytes) -> dict:
    """Ray Data's map over the window: one pass over its files in order; answer the window's ephemeral public key
    and which row groups were read, both padded to sizes that do not depend on the sample."""
    # This task's own records of the window (a Ray worker's ray-data log) would say when and how much it read.
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    read_files, read_groups, taken = [], [], []
    count = int(items["count"][0])
    plan = WindowPlan(*(np.asarray(items[name][0][:count], dtype=np.int64) for name in ("rows", "steps", "workers",
                                                                                          "positions")))
    starts = np.concatenate([[0], np.cumsum(dataset.row_counts)])
    cuts = np.searchsorted(plan.rows, starts)
    for file_index, path in enumerate(dataset.paths):
        if cuts[file_index + 1] > cuts[file_index]:
            batches, groups = gather_file(path, int(starts[file_index]),
                                          plan.rows[cuts[file_index]:cuts[file_index + 1]], list(dataset.columns),
                                          dataset.label)
            taken.extend(batches)
            read_files.extend([file_index] * len(groups))
            read_groups.extend(groups)
    features, labels = dataset.no_rows
    if taken:
        features, labels = _table_to_numpy(pa.Table.from_batches(taken), list(dataset.columns), dataset.label,
                                           dataset.max_length)
        features, labels = _feature_array(features).reshape(len(labels), -1), _label_array(labels)
    seal = WindowSeal(run)
    write_step_batches(features, labels, plan, folder, steps, workers, capacity, seal)
    padded = len(items["rows"][0])
    read = np.full((2, padded), -1, dtype=np.int64)
    read[0, :len(read_files)], read[1, :len(read_groups)] = read_files, read_groups
    return {"ephemeral": np.frombuffer(seal.ephemeral, dtype=np.uint8)[None], "file": read[:1], "group": read[1:]}


def gather_window(dataset: PlannedDataset, shares: Mapping[int, Sequence[np.ndarray]], folder: str, run: bytes,
                  capacity: int, node_id: str | None = None) -> tuple[list[tuple[int, int]], bytes]:
    """Gather the window's batches (`shares`, as for `window_plan`) of `dataset` into `folder` in one Ray Data pass.

    One Ray Data task, asking for no CPU, passes over the files in order
    and writes one file per (step, worker), sealed to the run's public key
    `run` and padded to `capacity` rows (`write_step_batches`). With
    `node_id`, the task runs on that node (the one whose disk holds the
    folder). The task's input (the plan) and output are padded to sizes
    that do not depend on the sample, and Ray Data writes no statistics or
    log lines of the pass (`quiet_ray_data`).
    Returns the (file, row group) pairs read, each once, and the window's
    ephemeral public key (`workers.window_keys.WindowSeal`); the rows
    themselves never come back.
    """
    import ray.data  # only a planned run needs Ray Data (and pandas)

    plan = window_plan(shares)
    workers = len(next(iter(shares.values())))
    padded = _padded_length(len(plan.rows), capacity * len(shares) * workers)
    item = {"count": len(plan.rows), **{name: np.pad(getattr(plan, name), (0, padded - len(plan.rows)))
                                        for name in ("rows", "steps", "workers", "positions")}}
    with quiet_ray_data():
        read = ray.data.from_items([item], override_num_blocks=1).map_batches(
            _gather_files, batch_size=1, batch_format="numpy",
            # No CPU of its own: the gradient workers may hold every CPU while the next window is gathered.
            fn_kwargs={"dataset": dataset, "folder": folder, "steps": range(min(shares), max(shares) + 1),
                       "workers": workers, "capacity": capacity, "run": run}, num_cpus=0,
            label_selector=None if node_id is None else on_node(node_id),
        ).take_all()
    (answer,) = read
    pairs = [(int(file), int(group)) for file, group in zip(answer["file"], answer["group"]) if file >= 0]
    return pairs, bytes(answer["ephemeral"])


@contextmanager
def quiet_ray_data():
    """Ray Data with no statistics, progress or log records of its own in this process, for the block's length.

    Its per-dataset log (``ray-data-dataset_*.log`` among Ray's logs)
    records each operator's bytes received, which is the size of a
    window's plan, and its console line each pass's time; both follow the
    sample. Warnings and errors still show. The "ray.data" logger's level is
    put back after the block, so a program that uses Ray Data itself keeps
    its own logs.
    """
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    context.enable_auto_log_stats = False
    context.verbose_stats_logs = False
    context.enable_stats_summary_collection = False
    logger = logging.getLogger("ray.data")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class PlannedBatch:
    """Where a worker finds its share of a step, and how it opens it.

    The window's folder, the step and the worker's number; ``run``, the
    run's window public key (the file's identity), and ``key``, the AES key
    of this one file (`workers.window_keys`), never shown.
    """

    folder: str
    step: int
    worker: int
    run: bytes = field(repr=False)
    key: bytes = field(repr=False)


def read_planned_batch(batch: PlannedBatch, dataset: PlannedDataset) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(inputs, labels) of a worker's share of a step, in the order of its share; None for an empty share."""
    with open(_batch_path(batch.folder, batch.step, batch.worker), "rb") as handle:
        plaintext = open_file(handle.read(), batch.key, batch.run, batch.step, batch.worker)
    rows = int.from_bytes(plaintext[:8], "little")
    if not rows:
        return None
    no_features, no_labels = dataset.no_rows
    width, label_width = no_features.shape[1], int(np.prod(no_labels.shape[1:]))
    # The file's slots past its rows are padding: the labels start after every slot's features.
    slots = (len(plaintext) - 8) // (no_features.itemsize * width + no_labels.itemsize * label_width)
    features = np.frombuffer(plaintext, no_features.dtype, rows * width, 8).reshape(rows, width)
    labels = np.frombuffer(plaintext, no_labels.dtype, rows * label_width, 8 + slots * width * no_features.itemsize)
    labels = labels.reshape(rows, *no_labels.shape[1:])
    return _feature_tensor(features.copy(), dataset.shape), _label_tensor(labels.copy())


class PlannedBatchReader:
    """A worker's reader of its planned batches of `dataset`, with the next one read on a background thread.

    It holds at most two batches: the step's and the next one's (read-ahead 1).
    """

    def __init__(self, dataset: PlannedDataset) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.dataset = dataset
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="planned-batch")
        self._ahead = None

    def prefetch(self, batch: PlannedBatch) -> None:
        """Start reading `batch` (replacing any read ahead not yet taken)."""
        self._ahead = (batch, self._reader.submit(read_planned_batch, batch, self.dataset))

    def read(self, batch: PlannedBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`batch`'s rows: those read ahead when it is the batch read ahead, else read now."""
        if self._ahead is not None and self._ahead[0] == batch:
            _, reading = self._ahead
            self._ahead = None
            return reading.result()
        return read_planned_batch(batch, self.dataset)


# A window's gathered rows on disk are held to about this many bytes when its length is chosen ("auto").
WINDOW_BYTES = 256 << 20
# ... and to at most this many steps, so that a run's first window is ready soon after it starts.
MAX_WINDOW_STEPS = 1000


def auto_window_steps(expected_batch_size: float, row_bytes: int, total_steps: int) -> int:
    """The steps of a window when plan_ahead_steps = "auto": about WINDOW_BYTES of rows, 1..MAX_WINDOW_STEPS.

    A long window spreads the fixed cost of a Ray Data pass (task start-up,
    planning: about 0.3 to 2 s on 2 loaded cores) over many steps, and gives
    the next window's gather as long as possible to finish while this one
    trains; its rows sit on disk, never in a worker's memory.
    """
    step_bytes = max(1.0, expected_batch_size * row_bytes)
    return int(max(1, min(MAX_WINDOW_STEPS, total_steps, WINDOW_BYTES // step_bytes)))


class PlannedWindows:
    """Windows of `window_steps` steps of `dataset`'s rows, each gathered while the one before trains.

    `shares_of(step)` is the step's sample split across the workers, as the
    step will send it; it is called on the gathering thread, so it must be a
    pure function of the step (the run key's PRF). `expected_share` is
    the expected rows of one worker's share of a step (public: it sets
    every file's padded size, `share_capacity`). Windows count from
    `first_step` (a resumed run's first step). The gathers run on the
    node `node_id` (the one whose disk holds the folders; give it on a
    cluster of several nodes). One background thread gathers the windows in order: when a
    window is first asked for, the next one is started, so at most three
    folders exist (the one whose last step may still be retried, the one
    training, the one gathering), and each is deleted once its steps ran.
    The files are sealed under the run's `WindowKey`, made here and held in
    this object's memory only.
    """

    def __init__(self, dataset: PlannedDataset, window_steps: int, total_steps: int,
                 shares_of: Callable[[int], Sequence[np.ndarray]], expected_share: float, first_step: int = 0,
                 node_id: str | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if window_steps < 1:
            raise ValueError(f"plan_ahead_steps must be >= 1 (got {window_steps})")
        self.dataset, self.window_steps, self.total_steps = dataset, window_steps, total_steps
        self.shares_of = shares_of
        self.first_step, self.node_id = first_step, node_id
        self.capacity = share_capacity(expected_share)
        self._key = WindowKey()
        # Every folder of these windows carries it in its name, so that `close` finds each one it made.
        self._owner = f"{os.getpid()}-{secrets.token_hex(4)}-"
        self.windows: dict[int, tuple[str, Future]] = {}
        # Folders that killed runs left on this node hold sampled rows: they go before this run makes its own.
        remove_stale_window_folders()
        self._gatherer = ThreadPoolExecutor(1, thread_name_prefix="window-gather")

    def start(self) -> None:
        """Start gathering the first window (before the workers start, so that both go on together)."""
        self._submit(0)

    def batch(self, step: int, worker: int) -> PlannedBatch | None:
        """Where worker `worker` finds its share of `step`, once its window is gathered (None past the last step)."""
        if step >= self.total_steps:
            return None
        window = (step - self.first_step) // self.window_steps
        self._submit(window)
        # The next window gathers while this one trains.
        self._submit(window + 1)
        folder, gathering = self.windows[window]
        return PlannedBatch(folder, step, worker, self._key.run, self._key.file_key(gathering.result(), step, worker))

    def done_with(self, step: int) -> None:
        """Delete the folders of the windows whose every step is at or before `step` (they ran)."""
        for window in [window for window in self.windows
                       if self.first_step + (window + 1) * self.window_steps <= step + 1]:
            folder, gathering = self.windows.pop(window)
            gathering.result()
            remove_window_folder(folder)

    def close(self) -> None:
        """Stop gathering and delete every window's folder (at the end of the run, or when it stops)."""
        for _, gathering in self.windows.values():
            gathering.cancel()
        self._gatherer.shutdown(wait=True)
        self.windows.clear()
        remove_owned_window_folders(self._owner)

    def _submit(self, window: int) -> None:
        start = self.first_step + window * self.window_steps
        if window in self.windows or start >= self.total_steps:
            return
        folder = private_window_folder(owner=self._owner)
        self.windows[window] = (folder, self._gatherer.submit(
            self._gather, range(start, min(start + self.window_steps, self.total_steps)), folder))

    def _gather(self, steps: range, folder: str) -> bytes:
        # Which row groups were read says which held a sampled row: it is dropped, never kept or logged.
        _, ephemeral = gather_window(self.dataset, {step: self.shares_of(step) for step in steps}, folder,
                                     self._key.run, self.capacity, self.node_id)
        return ephemeral


class PlannedRunSource:
    """A planned run's training rows [start, stop) of `dataset` on a worker (all by default), no footer parsed.

    Steps read from planned batches, so the worker keeps no per-row-group
    metadata (which grows with N). A read of no rows (the example's shape)
    comes from `dataset`; any other read (a feature cache, the non-private
    train loss) opens a `ParquetSource` over `spec` then and keeps it.
    Indices count from `start` (a silo worker's range of its shard).
    """

    def __init__(self, spec: Mapping, dataset: PlannedDataset, start: int = 0, stop: int | None = None) -> None:
        self.spec, self.dataset, self.start = spec, dataset, start
        self.size = (dataset.size if stop is None else stop) - start
        self.source: ParquetSource | None = None

    def __len__(self) -> int:
        return self.size

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at ``indices`` through a Parquet source (opened for the first read of any)."""
        if not len(indices) and self.source is None:
            return self.dataset.no_rows_tensors()
        if self.source is None:
            self.source = ParquetSource(self.spec, "train")
        return self.source.read(np.asarray(indices) + self.start)
