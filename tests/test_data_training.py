"""Training on file and module:function datasets through the real trainer, a local Ray and the CLI."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from orchestrator.cli import main
from orchestrator.config import build_config
from orchestrator.trainer import Trainer
from workers.actor import GradientWorkerActor
from workers.data import load_split
from workers.models import flat_parameters
from workers.sources import FIND_ROWS, write_parquet_shards

TESTS_DIR = str(Path(__file__).resolve().parent)
TRAIN_ROWS, TEST_ROWS = 600, 200


@pytest.fixture(scope="module")
def ray_with_read_probe(tmp_path_factory):
    """A local Ray of its own whose workers can import this module and know the driver's pid."""
    reads = tmp_path_factory.mktemp("reads")
    variables = {"DPFLEET_TEST_DRIVER_PID": str(os.getpid()), "DPFLEET_TEST_READS": str(reads),
                 "PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    os.environ.update({key: variables[key] for key in ("DPFLEET_TEST_DRIVER_PID", "DPFLEET_TEST_READS")})
    # "local": a new Ray for this module even while another on this machine advertises itself.
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": variables})
    yield reads
    ray.shutdown()


def small_config(tmp_path, dataset, **overrides):
    values = dict(dataset=dataset, model="gdp_cnn", workers=2, steps=4, batch_size=60, noise_multiplier=1.1,
                  clip_norm=1.0, learning_rate=0.5, seed=13, run_dir=str(tmp_path / "run"), max_physical_batch=32)
    values.update(overrides)
    return build_config(values)


def export_mnist_head(directory: Path) -> dict:
    """The first 600 training and 200 test examples of MNIST as Parquet shards; returns the dataset table."""
    for split, rows, shards in (("train", TRAIN_ROWS, 3), ("test", TEST_ROWS, 1)):
        images, labels = load_split("mnist", split)
        write_parquet_shards(str(directory / split), [(images[:rows].numpy(), labels[:rows].numpy())], rows, shards)
    return {"format": "parquet", "train": str(directory / "train"), "test": str(directory / "test"),
            "shape": [1, 28, 28], "features": "features"}


def test_parquet_training_matches_the_built_in_run_on_the_same_examples(ray_with_read_probe, tmp_path):
    table = export_mnist_head(tmp_path / "mnist")
    # Row by row: tests/test_planned_batches.py holds the planned batches to the same run.
    from_files = Trainer(small_config(tmp_path / "a", table, check_data="full", plan_ahead_steps="off"),
                         show_progress=False)
    built_in = Trainer(small_config(tmp_path / "b", "mnist", train_subset=TRAIN_ROWS, test_subset=TEST_ROWS),
                       show_progress=False)
    summaries = [from_files.run(), built_in.run()]
    # Same seed, same examples at the same indices: the same samples, sums, noise and steps.
    assert summaries[0]["dataset_size"] == TRAIN_ROWS and summaries[0]["steps"] == 4
    assert summaries[0]["test_accuracy"] == summaries[1]["test_accuracy"]
    torch.testing.assert_close(flat_parameters(from_files.model), flat_parameters(built_in.model))


class GuardedDataset(torch.utils.data.Dataset):
    """Random MNIST-shaped examples; reading a training example in the driver's process fails the run."""

    def __init__(self, count: int, split: str) -> None:
        self.count, self.split = count, split

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        if self.split == "train":
            if os.getpid() == int(os.environ["DPFLEET_TEST_DRIVER_PID"]):
                raise AssertionError(f"the driver read training example {index}")
            Path(os.environ["DPFLEET_TEST_READS"], str(os.getpid())).touch()
        generator = torch.Generator().manual_seed(index)
        return torch.rand(1, 28, 28, generator=generator), index % 10


def guarded_datasets():
    return GuardedDataset(TRAIN_ROWS, "train"), GuardedDataset(TEST_ROWS, "test")


def test_the_driver_never_reads_a_training_example(ray_with_read_probe, tmp_path):
    reads = ray_with_read_probe
    config = small_config(tmp_path, "test_data_training:guarded_datasets")
    summary = Trainer(config, show_progress=False).run()
    assert summary["dataset_size"] == TRAIN_ROWS and summary["steps"] == 4
    readers = {int(path.name) for path in reads.iterdir()}
    assert readers and os.getpid() not in readers


def write_config(tmp_path: Path, dataset_lines: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(f'steps = 2\nbatch_size = 10\nnoise_multiplier = 1.0\nrun_dir = "{tmp_path / "run"}"\n'
                    f'check_data = "full"\n{dataset_lines}')
    return path


def test_a_bad_file_is_one_line_and_exit_status_2_before_any_worker(tmp_path, capsys):
    rows = [[0.5] * 784 for _ in range(40)]
    rows[23] = [0.5] * 700
    pq.write_table(pa.table({"features": rows, "label": np.arange(40) % 10}), tmp_path / "train.parquet")
    pq.write_table(pa.table({"features": [[0.5] * 784] * 5, "label": np.arange(5)}), tmp_path / "test.parquet")
    config = write_config(tmp_path, f'[dataset]\nformat = "parquet"\ntrain = "{tmp_path / "train.parquet"}"\n'
                                    f'test = "{tmp_path / "test.parquet"}"\nshape = [1, 28, 28]\n')
    assert main(["train", "--config", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"dpfleet train: error: {tmp_path / 'train.parquet'}: column 'features': every example needs 784 "
                   "values (null or another length); write every example with the same number of features; "
                   f"{FIND_ROWS}")


def test_full_check_takes_num_classes_from_the_model(tmp_path, capsys):
    images = np.full((30, 784), 0.5, dtype=np.float32)
    labels = np.arange(30) % 10
    labels[12] = 10  # gdp_cnn has 10 outputs
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", labels)
    files = f'{{ features = "{tmp_path / "x.npy"}", label = "{tmp_path / "y.npy"}" }}'
    config = write_config(tmp_path, f'[dataset]\nformat = "npy"\ntrain = {files}\ntest = {files}\n'
                                    'shape = [1, 28, 28]\n')
    rule = (f"dpfleet train: error: {tmp_path / 'y.npy'}: column 'label': labels must lie in 0..9 (num_classes 10); "
            "give the model one output per class, set the dataset's num_classes, or set check_data = \"lenient\" to "
            "drop those rows")
    assert main(["train", "--config", str(config), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == f"{rule}; {FIND_ROWS}"
    # The data's owner may ask for the rows and values.
    assert main(["train", "--config", str(config), "--no-progress", "--show-values"]) == 2
    assert capsys.readouterr().err.strip() == f"{rule}; 1 of rows 0..29 break it: row 12 (label 10)"


def test_export_writes_shards_that_train(tmp_path, capsys):
    assert main(["data", "export", "mnist", "--format", "parquet", "--shards", "4", str(tmp_path / "out")]) == 0
    assert sorted(path.name for path in (tmp_path / "out" / "train").iterdir()) == [
        f"part-{shard:05d}.parquet" for shard in range(4)]
    assert sum(pq.ParquetFile(path).metadata.num_rows for path in (tmp_path / "out" / "test").iterdir()) == 10000
    assert 'shape = [1, 28, 28]' in capsys.readouterr().out


def test_a_sigkilled_worker_leaves_no_copy_of_its_csv_rows(ray_with_read_probe, tmp_path):
    # Ray ends workers with SIGKILL, so nothing the worker would do at exit runs: the copy must need no cleanup.
    rows = np.random.default_rng(3).random((40, 784), dtype=np.float32)
    header = ",".join([*(f"x{i}" for i in range(784)), "label"])
    lines = [",".join([*(repr(float(value)) for value in row), str(index % 10)]) for index, row in enumerate(rows)]
    (tmp_path / "train.csv").write_text("\n".join([header, *lines]) + "\n")
    dataset = {"format": "csv", "train": str(tmp_path / "train.csv"), "test": str(tmp_path / "train.csv"),
               "shape": [1, 28, 28]}
    scratch = tmp_path / "worker-tmp"
    scratch.mkdir()
    worker = GradientWorkerActor.options(runtime_env={"env_vars": {"TMPDIR": str(scratch)}}).remote(
        "gdp_cnn", dataset, None, 32)
    pid = int(ray.get(worker.ping.remote()).rpartition(":")[2])
    summed = ray.get(worker.clipped_grad_sum.remote(np.zeros(ray.get(worker.parameter_count.remote()), np.float32),
                                                    np.arange(40), 1.0))
    assert np.abs(summed).sum() > 0  # the worker read its rows through the copy
    mapped = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if str(scratch) in line]
    assert mapped and all(line.endswith("(deleted)") for line in mapped)  # mapped, and reachable by no path
    assert list(scratch.iterdir()) == []
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()
    assert list(scratch.iterdir()) == []
    ray.kill(worker)
