"""Runs stopped by SIGKILL or SIGTERM at a random step leave no training row, sample or step size anywhere.

Each test runs `dpfleet train` three times at once, each in a process of
its own joined to the module's Ray, on 2,000 Parquet rows that each start
with a marker of seven floats and hold their row id as feature 7:
driver-sampled, planned ahead four steps a window, and in two silos that
plan their own windows. It stops each run at a random step, then plays the
attacker of docs/threat-model.md ("Temporary data") on what is left: the
drivers' temporary folders, Ray's own folder (its logs, spilled objects
and its workers' temporary files) and /dev/shm. It looks for the marker's
bytes (float32 and float64), for every file that opens as Arrow IPC and
holds a marked row, for runs of row ids (a sample's indices), for Ray
Data's per-dataset byte counts and pass times, and for window files of
different sizes (a step's sample size). SIGTERM must take Ctrl-C's path:
status 130, and no window left.
"""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as pa_ipc
import pytest
import ray
from servers import DPFLEET, REPOSITORY
from test_planned_batches import write_default_parquet

from workers.planned_batches import WINDOW_PREFIX, remove_stale_window_folders

ROWS = 2000
MODES = ("driver", "planned", "silo")
# The first seven features of every row: exact binary fractions, so float32 and float64 hold them alike.
MARKER = np.array([0.8125, -0.6875, 0.40625, 0.96875, -0.21875, 0.59375, -0.90625])
PATTERNS = {MARKER.astype(np.float32).tobytes(): "a training row (float32)",
            MARKER.astype(np.float64).tobytes(): "a training row (float64)"}
# Ray Data's per-dataset lines that carry a pass's input bytes or its time, both of which follow the sample's size.
SIZE_LINES = re.compile(r"bytes_inputs_received|bytes_outputs_taken|execution finished in|num_rows")
# Files larger than this are not read whole (none of a tiny run's are).
LARGEST_FILE = 64 << 20


@pytest.fixture(scope="module")
def marked_rows(tmp_path_factory):
    """The Parquet split: row i is the marker, then i (feature 7), then noise; 10 classes."""
    generator = np.random.default_rng(47)
    features = generator.normal(size=(ROWS, 784)).astype(np.float32)
    features[:, :7] = MARKER
    features[:, 7] = np.arange(ROWS)
    return write_default_parquet(tmp_path_factory.mktemp("marked") / "data", features.reshape(ROWS, 1, 28, 28),
                                 generator.integers(0, 10, ROWS), files=2)


def job_config(folder: Path, spec: dict, mode: str) -> Path:
    """A TOML job of many small steps over the marked rows in `mode`: driver, planned (4 steps a window) or silo."""
    dataset = (f'{{ format = "parquet", train = "{spec["train"]}", test = "{spec["test"]}", features = "features", '
               'shape = [1, 28, 28] }')
    lines = ['model = "bench.mlp:mlp_tiny"', "steps = 5000", "batch_size = 20", "noise_multiplier = 1.0",
             "clip_norm = 1.0", "learning_rate = 0.1", "max_physical_batch = 64", "test_subset = 100",
             f'run_dir = "{folder / "run"}"']
    if mode == "silo":
        lines += ["plan_ahead_steps = 4", "[[shards]]", f"dataset = {dataset}", "part = 0", "parts = 2",
                  "[[shards]]", f"dataset = {dataset}", "part = 1", "parts = 2"]
    else:
        lines += ["workers = 1", f"dataset = {dataset}",
                  'plan_ahead_steps = 4' if mode == "planned" else 'plan_ahead_steps = "off"']
    path = folder / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def window_folders(parent: Path) -> set[Path]:
    return {path for path in parent.iterdir() if path.name.startswith(WINDOW_PREFIX) and path.is_dir()}


def files_under(roots: list[Path]):
    for root in roots:
        if root.is_file():
            yield root
        for folder, _, names in os.walk(root):
            for name in names:
                path = Path(folder) / name
                if path.is_file() and not path.is_symlink() and path.stat().st_size <= LARGEST_FILE:
                    yield path


def row_id_runs(data: bytes) -> bool:
    """Whether `data` holds four increasing row ids as consecutive int64 values, at any alignment (a sample)."""
    for offset in range(8):
        values = np.frombuffer(data[offset:offset + (len(data) - offset) // 8 * 8], dtype="<i8")
        if len(values) < 4:
            continue
        ids = (values >= 0) & (values < ROWS)
        rising = ids[:-1] & ids[1:] & (values[:-1] < values[1:])
        if np.any(rising[:-2] & rising[1:-1] & rising[2:]):
            return True
    return False


def marked_arrow_rows(data: bytes) -> int:
    """The marked rows in `data` read as an Arrow IPC file or stream (0 when it is neither)."""
    for opener in (pa_ipc.open_file, pa_ipc.open_stream):
        try:
            table = opener(pa.BufferReader(data)).read_all()
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError):
            continue
        marked = 0
        for column in table.columns:
            values = column.combine_chunks()
            while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type):
                values = values.flatten()
            if pa.types.is_floating(values.type):
                marked += int(np.sum(np.isclose(values.to_numpy(zero_copy_only=False), MARKER[0])))
        return marked
    return 0


# Lines that say why a process ended otherwise than it should: an abort's cause, a fatal error, a traceback's end.
WHY_LINES = re.compile(r"Check failed|terminate called|Fatal|FATAL|received at time|Aborted|Error:|Traceback")


def why_it_ended(output: str) -> str:
    """The first lines of `output` that say why its process ended (an abort's cause comes before its long stack)."""
    lines = [line[:300] for line in output.splitlines() if WHY_LINES.search(line)][:8]
    return "\n".join(lines) + "\n...\n" if lines else ""


def attack(roots: list[Path], window_parents: list[Path], since: float) -> list[str]:
    """What an attacker finds in `roots` and in the window folders of `window_parents`: rows, samples, sizes.

    Ray Data's logs are read when written since `since`.
    """
    new_windows = set().union(*(window_folders(parent) for parent in window_parents))
    findings = []
    for path in files_under([*roots, *new_windows]):
        try:
            data = path.read_bytes()
        except OSError:  # gone meanwhile, or a socket
            continue
        findings += [f"{path}: {what}" for pattern, what in PATTERNS.items() if pattern in data]
        if marked_arrow_rows(data):
            findings.append(f"{path}: Arrow IPC holding marked rows")
        if row_id_runs(data):
            findings.append(f"{path}: a run of row ids (a sample)")
        if "ray-data" in path.name and path.stat().st_mtime >= since:
            findings += [f"{path}: {line.strip()[:120]}" for line in data.decode(errors="replace").splitlines()
                         if SIZE_LINES.search(line)]
    for parent in window_parents:
        # One run's windows lie in each parent (the silos' two have the same expected share).
        sizes = {path.stat().st_size for folder in window_folders(parent) for path in folder.iterdir()}
        if len(sizes) > 1:
            findings.append(f"{parent}: window files of {len(sizes)} sizes ({sorted(sizes)}): each step's size")
    return findings


@pytest.fixture(scope="module")
def ray_in_a_folder():
    """A local Ray of 8 logical CPUs (three runs at once) whose files, and its workers' temporary files (a silo's
    windows), all lie in a folder of its own; yields (its address, the folder)."""
    from orchestrator.trainer import init_local_ray

    # Short: Ray's socket paths under it must stay short.
    folder = Path(tempfile.mkdtemp(prefix="dpx-", dir="/tmp"))
    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(folder))
        init_local_ray(8, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address, folder
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def start_job(folder: Path, spec: dict, mode: str, ray_address: str) -> subprocess.Popen:
    """`dpfleet train` of `mode` in a process of its own, joined to the Ray at `ray_address`; its temporary files
    (a driver's windows) go to `folder` / "tmp", its output to `folder` / "train.log"."""
    (folder / "tmp").mkdir(parents=True)
    with open(folder / "train.log", "w") as log:
        return subprocess.Popen([*DPFLEET, "train", "--config", str(job_config(folder, spec, mode)), "--no-progress"],
                                cwd=REPOSITORY, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "RAY_ADDRESS": ray_address, "TMPDIR": str(folder / "tmp")})


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_runs_stopped_at_a_random_step_leave_no_row_sample_or_step_size(ray_in_a_folder, marked_rows, tmp_path,
                                                                        stop):
    """A driver-sampled, a planned and a silo run at once, each stopped at its own random step."""
    ray_address, ray_folder = ray_in_a_folder
    seed = int.from_bytes(os.urandom(4), "big")
    waits = dict(zip(MODES, np.random.default_rng(seed).uniform(0.2, 2.0, len(MODES))))
    started = time.time()
    jobs = {mode: start_job(tmp_path / mode, marked_rows, mode, ray_address) for mode in MODES}
    pending, deadline = dict(jobs), time.monotonic() + 240
    while pending:
        for mode, job in list(pending.items()):
            # The epoch-0 row is written just before the first step: from there, the mode's random moment.
            metrics = tmp_path / mode / "run" / "metrics.jsonl"
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / mode / "train.log").read_text()
            if metrics.exists() and time.time() - metrics.stat().st_mtime >= waits[mode]:
                job.send_signal(stop)
                del pending[mode]
        time.sleep(0.02)
    context = {}
    for mode, job in jobs.items():
        status = job.wait(timeout=120)
        output = (tmp_path / mode / "train.log").read_text()
        context[mode] = (f"{mode}, {stop.name} {waits[mode]:.2f} s into training (seed {seed}): "
                         f"{why_it_ended(output)}{output[-1500:]}")
        assert status == (-signal.SIGKILL if stop == signal.SIGKILL else 130), context[mode]
        if stop == signal.SIGTERM:
            # Ctrl-C's path: the windows were closed and the steps not run released.
            assert "dpfleet train: interrupted" in output, context[mode]
    parents = [ray_folder, *(tmp_path / mode / "tmp" for mode in MODES)]
    if stop == signal.SIGTERM:
        assert [folder for parent in parents for folder in window_folders(parent)] == [], context
    else:
        # Nothing cleans up after a SIGKILL: the planned and silo runs' windows are there to attack.
        assert window_folders(tmp_path / "planned" / "tmp") and window_folders(ray_folder), context
    # Ray's folder holds its logs, spilled objects and its workers' temporary files. Of /dev/shm, what the runs'
    # user wrote: another user's segments (a PostgreSQL server's) are not the runs'.
    shared_memory = [path for path in Path("/dev/shm").iterdir() if path.stat().st_uid == os.getuid()]
    assert attack([*parents, *shared_memory], parents, started) == [], context
    # A killed run's windows are stale once its processes are gone: the next run's sweep removes them.
    deadline = time.monotonic() + 60
    while any(window_folders(parent) for parent in parents):
        for parent in parents:
            remove_stale_window_folders(str(parent))
        assert time.monotonic() < deadline, context
        time.sleep(0.5)
