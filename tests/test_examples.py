"""Every shipped example configuration validates and plans a run."""

from pathlib import Path

import pytest

from accounting.accountants import get_accountant
from orchestrator.config import load_config
from orchestrator.trainer import plan_run
from workers.data import dataset_size
from workers.shards import worker_bounds

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_validates_and_plans(path):
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
