"""Every shipped example configuration validates and plans a run."""

from pathlib import Path

import pytest

import numpy as np

from accounting.accountants import get_accountant
from orchestrator.config import load_config
from orchestrator.planning import plan_run
from workers.sources import write_parquet_shards
from workers.data import dataset_size
from workers.shards import worker_bounds

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.toml"))


@pytest.fixture
def exported_parquet(tmp_path, monkeypatch):
    """Stand-in files where examples/mnist_parquet.toml expects `dpfleet data export`'s output (relative to cwd)."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    for split, rows in (("train", 1000), ("test", 100)):
        features = rng.random((rows, 784), dtype=np.float32)
        write_parquet_shards(f"data/mnist-parquet/{split}", [(features, np.arange(rows) % 10)], rows, 2)


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_validates_and_plans(path, exported_parquet):
    config = load_config(str(path), {})
    # With shards, N is what the workers will report: the examples of their ranges, added up.
    shard_examples = [stop - start for shard in config.shards for worker in range(shard.workers)
                      for start, stop in [worker_bounds(dataset_size(shard.dataset), shard, worker)]]
    plan = plan_run(config, sum(shard_examples) if config.shards else None)
    assert plan.steps >= 1
    assert get_accountant("pld").epsilon(plan.planned_events, config.delta) > 0


def test_the_main_job_is_the_seed_configuration():
    plan = plan_run(load_config(str(EXAMPLES_DIR / "mnist.toml"), {}))
    assert (plan.steps, plan.noise_multiplier, plan.sampling_rate) == (3600, 1.3, 250 / 60000)
    assert get_accountant("pld").epsilon(plan.planned_events, 1e-5) == pytest.approx(0.853, abs=0.002)
