"""Batches planned ahead: the window's plan, its one-pass gather by Ray Data, and training from them."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.planned_windows import run_planned_batches
from orchestrator.trainer import Trainer
from workers.data import load_split
from workers.models import flat_parameters
from workers.planned_batches import MAX_WINDOW_STEPS, WINDOW_BYTES, WINDOW_PREFIX, PlannedBatch, PlannedRunSource, \
    PlannedWindows, auto_window_steps, gather_window, private_window_folder, read_planned_batch, \
    read_planned_dataset, remove_stale_window_folders, remove_window_folder, share_capacity, window_plan
from workers.window_keys import WindowKey

TRAIN_ROWS, TEST_ROWS = 600, 200


@given(st.dictionaries(st.integers(0, 20), st.lists(st.lists(st.integers(0, 99), max_size=12), min_size=1,
                                                     max_size=3), max_size=5))
@settings(max_examples=60, deadline=None)
def test_a_window_plan_lists_every_sampled_example_once_per_step_sorted_by_row(shares):
    plan = window_plan({step: [np.asarray(share, dtype=np.int64) for share in parts]
                        for step, parts in shares.items()})
    assert np.all(np.diff(plan.rows) >= 0)
    for step, parts in shares.items():
        for worker, share in enumerate(parts):
            mine = (plan.steps == step) & (plan.workers == worker)
            # Put back in position order, the entries are the share as the step sends it.
            assert plan.rows[mine][np.argsort(plan.positions[mine])].tolist() == share


def write_default_parquet(directory: Path, features: np.ndarray, labels: np.ndarray, files: int,
                          row_group_size: int | None = None) -> dict:
    """`files` Parquet files as pyarrow writes them by default (one row group a file), or in groups of a size."""
    directory.mkdir(parents=True)
    element = pa.field("element", pa.float32(), nullable=False)
    for part, rows in enumerate(np.array_split(np.arange(len(labels)), files)):
        flat = pa.array(features[rows].reshape(len(rows), -1).ravel())
        table = pa.table({"features": pa.FixedSizeListArray.from_arrays(flat, type=pa.list_(element,
                                                                                            features[0].size)),
                          "label": labels[rows]})
        pq.write_table(table, directory / f"part-{part}.parquet", row_group_size=row_group_size)
    return {"format": "parquet", "train": str(directory), "test": str(directory), "features": "features",
            "shape": list(features.shape[1:])}


def test_a_window_is_gathered_reading_each_row_group_at_most_once_and_gives_each_share_in_order(local_ray, tmp_path,
                                                                                              request):
    generator = np.random.default_rng(3)
    features = generator.normal(size=(1000, 6)).astype(np.float32)
    labels = generator.integers(0, 5, 1000)
    spec = write_default_parquet(tmp_path / "data", features, labels, files=3, row_group_size=70)
    # Eight steps of two workers, each step a fresh sample: many rows share a row group, some rows several steps.
    shares = {step: np.array_split(np.flatnonzero(generator.random(1000) < 0.05), 2) for step in range(8)}
    folder = private_window_folder()
    request.addfinalizer(lambda: remove_window_folder(folder))
    dataset = read_planned_dataset(spec)
    key = WindowKey()
    read, ephemeral = gather_window(dataset, shares, folder, key.run, share_capacity(25))
    assert len(read) == len(set(read))
    sampled = np.unique(np.concatenate([np.concatenate(parts) for parts in shares.values()]))
    file_starts = np.array([0, 334, 667])
    group_of = {(int(np.searchsorted(file_starts, row, side="right") - 1),
                 int((row - file_starts[np.searchsorted(file_starts, row, side="right") - 1]) // 70))
                for row in sampled}
    assert set(read) == group_of
    assert os.stat(folder).st_mode & 0o777 == 0o700
    for step, parts in shares.items():
        for worker, share in enumerate(parts):
            inputs, gathered_labels = read_planned_batch(
                PlannedBatch(folder, step, worker, key.run, key.file_key(ephemeral, step, worker)), dataset)
            np.testing.assert_array_equal(inputs.numpy(), features[share])
            np.testing.assert_array_equal(gathered_labels.numpy(), labels[share])


def test_a_planned_source_knows_its_rows_and_example_shape_from_the_footers_read_once(tmp_path):
    """The footers are read once (`read_planned_dataset`): a worker's source, given what they said, opens no file."""
    features = np.arange(1000 * 12, dtype=np.float64).reshape(1000, 3, 4)
    spec = write_default_parquet(tmp_path / "data", features.astype(np.float32), np.arange(1000) % 7, files=3,
                                 row_group_size=70)
    dataset = read_planned_dataset(spec)
    assert dataset.row_counts == (334, 333, 333) and dataset.size == 1000
    assert dataset.columns == ("features",) and dataset.label == "label" and dataset.shape == (3, 4)
    assert dataset.row_bytes == 12 * 4 + 8
    for path in dataset.paths:
        os.remove(path)
    source = PlannedRunSource(spec, dataset, 100, 400)
    inputs, labels = source.read(np.zeros(0, dtype=np.int64))
    assert len(source) == 300
    assert inputs.shape == (0, 3, 4) and inputs.dtype == torch.float32 and labels.shape == (0,)
    assert labels.dtype == torch.int64


HOLD_A_WINDOW_FOLDER = """
import sys, time
from workers.planned_batches import private_window_folder
print(private_window_folder(sys.argv[1]), flush=True)
time.sleep(600)
"""


def test_a_killed_processs_window_folder_is_removed_and_a_live_ones_never(tmp_path, request):
    """A process that holds a window folder is killed (SIGKILL: nothing of its own runs): the next sweep removes
    its folder and lock, and leaves the folders of a live process and of this one, and a folder with no lock."""
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    holders = [subprocess.Popen([sys.executable, "-c", HOLD_A_WINDOW_FOLDER, str(tmp_path)], stdout=subprocess.PIPE,
                                text=True, env=environment) for _ in range(2)]
    for holder in holders:
        request.addfinalizer(holder.kill)
    killed, alive = (Path(holder.stdout.readline().strip()) for holder in holders)
    (killed / "step-000000000-worker-00000.arrow").write_bytes(b"sampled rows")
    mine = private_window_folder(str(tmp_path))
    request.addfinalizer(lambda: remove_window_folder(mine))
    lockless = Path(tempfile.mkdtemp(prefix=WINDOW_PREFIX, dir=tmp_path))
    assert remove_stale_window_folders(str(tmp_path)) == []
    assert killed.is_dir() and alive.is_dir()
    holders[0].kill()
    holders[0].wait()
    assert remove_stale_window_folders(str(tmp_path)) == [str(killed)]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [alive.name, alive.name + ".lock", Path(mine).name, Path(mine).name + ".lock", lockless.name])
    assert os.stat(mine).st_mode & 0o777 == 0o700
    remove_window_folder(mine)
    assert not os.path.exists(mine) and not os.path.exists(mine + ".lock")


def test_the_next_window_gathers_while_one_trains_and_each_folder_goes_once_its_steps_ran(local_ray, tmp_path):
    generator = np.random.default_rng(5)
    features = generator.normal(size=(300, 4)).astype(np.float32)
    labels = generator.integers(0, 3, 300)
    spec = write_default_parquet(tmp_path / "data", features, labels, files=2)
    samples = {step: np.flatnonzero(np.random.default_rng(step).random(300) < 0.1) for step in range(7)}
    # A resumed run from step 1: windows of three steps, 1-3, 4-6, 7.
    dataset = read_planned_dataset(spec)
    windows = PlannedWindows(dataset, 3, 8, lambda step: np.array_split(samples.get(step, np.zeros(0, int)), 2),
                             expected_share=15, first_step=1)
    try:
        windows.start()
        batch = windows.batch(2, 1)
        assert sorted(windows.windows) == [0, 1]
        inputs, _ = read_planned_batch(batch, dataset)
        np.testing.assert_array_equal(inputs.numpy(), features[np.array_split(samples[2], 2)[1]])
        first_folder = windows.windows[0][0]
        windows.done_with(3)
        assert not os.path.exists(first_folder) and sorted(windows.windows) == [1]
        assert windows.batch(8, 0) is None
        # Step 7 holds no sample: its shares' files hold no row and read as empty.
        assert read_planned_batch(windows.batch(7, 0), dataset) is None
        folders = [folder for folder, _ in windows.windows.values()]
    finally:
        windows.close()
    assert not any(os.path.exists(folder) for folder in folders)


def test_an_auto_window_holds_about_window_bytes_of_rows_within_its_step_limits():
    assert auto_window_steps(256, 264, 100_000) == MAX_WINDOW_STEPS
    assert auto_window_steps(250, 3144, 100_000) == WINDOW_BYTES // (250 * 3144)
    assert auto_window_steps(250, 3144, 60) == 60
    assert auto_window_steps(1e6, 1e6, 100) == 1


def small_config(tmp_path, dataset, **overrides):
    values = dict(dataset=dataset, model="gdp_cnn", workers=2, steps=4, batch_size=60, noise_multiplier=1.1,
                  clip_norm=1.0, learning_rate=0.5, seed=13, run_dir=str(tmp_path / "run"), max_physical_batch=32)
    values.update(overrides)
    return build_config(values)


def test_planned_training_from_default_parquet_takes_the_in_memory_runs_batches(local_ray, tmp_path, monkeypatch):
    images, labels = load_split("mnist", "train")
    spec = write_default_parquet(tmp_path / "mnist", images[:TRAIN_ROWS].numpy(), labels[:TRAIN_ROWS].numpy(),
                                 files=2)
    windows = tmp_path / "windows"
    windows.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(windows))
    # Three steps a window over four steps: the second window is gathered while the first runs its last step.
    planned = Trainer(small_config(tmp_path / "planned", spec, plan_ahead_steps=3, test_subset=TEST_ROWS),
                      show_progress=False)
    in_memory = Trainer(small_config(tmp_path / "memory", "mnist", train_subset=TRAIN_ROWS, test_subset=TEST_ROWS),
                        show_progress=False)
    planned.run()
    in_memory.run()
    # The same seed and rows: the same samples, sums, noise and steps.
    torch.testing.assert_close(flat_parameters(planned.model), flat_parameters(in_memory.model))
    assert list(windows.iterdir()) == []


@pytest.mark.parametrize("overrides, message", [
    (dict(dataset="mnist"), "give a parquet dataset"),
    (dict(privacy_unit="user", synthetic_users=10, max_examples_per_user=4), 'privacy_unit = "user"'),
    (dict(check_data="lenient"), "cannot be combined with plan_ahead_steps"),
])
@pytest.mark.parametrize("value", [4, "auto"])
def test_planned_batches_are_refused_where_they_do_not_apply(tmp_path, overrides, message, value):
    spec = {"format": "parquet", "train": str(tmp_path), "test": str(tmp_path)}
    overrides = dict(overrides)
    with pytest.raises(UsageError, match=message):
        small_config(tmp_path, overrides.pop("dataset", spec), plan_ahead_steps=value, **overrides)


@pytest.mark.parametrize("overrides, one_node, planned, reason", [
    (dict(), True, "auto", None),
    (dict(plan_ahead_steps=3), False, 3, None),
    (dict(plan_ahead_steps="off"), True, None, 'plan_ahead_steps = "off"'),
    (dict(privacy_unit="user", synthetic_users=10, batch_size=5), True, None,
     'privacy_unit = "user" cannot use planned batches'),
    (dict(aggregation="collective", check_data="lenient"), True, None,
     'aggregation = "collective", check_data = "lenient" cannot use planned batches'),
    (dict(), False, None, 'on a Ray cluster planned batches are gathered on the driver\'s node'),
    (dict(dataset="mnist"), True, None, None),
])
def test_planned_batches_are_the_default_for_parquet_and_a_table_read_row_by_row_says_why(
        tmp_path, overrides, one_node, planned, reason):
    spec = write_default_parquet(tmp_path / "data", np.zeros((100, 1, 28, 28), np.float32), np.zeros(100, np.int64),
                                 files=1)
    overrides = dict(overrides)
    config = small_config(tmp_path, overrides.pop("dataset", spec), **overrides)
    steps, why = run_planned_batches(config, one_node)
    assert steps == planned
    assert why == reason if reason is None else why.startswith(reason)


@pytest.mark.parametrize("value", [0, -2, "later", True, 2.5])
def test_plan_ahead_steps_is_a_whole_number_of_steps_auto_or_off(tmp_path, value):
    spec = write_default_parquet(tmp_path / "data", np.zeros((100, 1, 28, 28), np.float32), np.zeros(100, np.int64),
                                 files=1)
    assert small_config(tmp_path, spec, plan_ahead_steps="auto").plan_ahead_steps == "auto"
    with pytest.raises(UsageError, match=r'plan_ahead_steps must be a whole number >= 1, "auto" or "off"'):
        small_config(tmp_path, spec, plan_ahead_steps=value)
