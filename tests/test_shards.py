"""Shards without a cluster: local Poisson sampling (statistical tests with fixed seeds), ranges, config, workers."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.cli.train import outage_rows
from orchestrator.planning import plan_run
from workers.data import load_split
from workers.sampling import local_poisson_sample, local_sampling_key, part_bounds
from workers.shard_worker import ShardWorker
from workers.shards import ShardSpec, worker_bounds

# Three shards of a 600-example source, the middle one split between two workers: four disjoint ranges.
SOURCE_SIZE = 600
SHARDS = (ShardSpec("mnist", 0, 3), ShardSpec("mnist", 1, 3, workers=2), ShardSpec("mnist", 2, 3))
SLOTS = [(shard, worker) for shard, spec in enumerate(SHARDS) for worker in range(spec.workers)]


def union_sample(seed, step, rate):
    """The examples (positions in the source) that all workers sample at `step`, and each shard's count."""
    chosen, per_shard = [], np.zeros(len(SHARDS), dtype=int)
    for shard, worker in SLOTS:
        start, stop = worker_bounds(SOURCE_SIZE, SHARDS[shard], worker)
        local = local_poisson_sample(local_sampling_key(seed, shard, worker), step, stop - start, rate)
        chosen.append(start + local)
        per_shard[shard] += local.size
    return np.concatenate(chosen), per_shard


@given(st.integers(1, 5000), st.integers(1, 7), st.integers(1, 5))
def test_the_workers_of_all_shards_tile_the_source_once(size, parts, workers):
    covered = np.zeros(size, dtype=int)
    for part in range(parts):
        shard = ShardSpec("mnist", part, parts, workers=workers)
        for worker in range(workers):
            start, stop = worker_bounds(size, shard, worker)
            covered[start:stop] += 1
    assert np.all(covered == 1)


def test_part_bounds_refuses_a_part_outside_the_parts():
    with pytest.raises(ValueError, match=r"part must be in 0..2 for parts = 3 \(got 3\)"):
        part_bounds(10, 3, 3)


def test_each_example_of_the_union_is_included_at_rate_q():
    # Chi-square of 600 per-example inclusion counts over 3000 steps against Binomial(3000, q):
    # the statistic is about chi2(600) when every example joins independently with probability q.
    rate, steps = 0.1, 3000
    counts = np.zeros(SOURCE_SIZE)
    for step in range(steps):
        chosen, _ = union_sample(21, step, rate)
        assert np.unique(chosen).size == chosen.size  # no example drawn twice in a step
        counts[chosen] += 1
    statistic = np.sum((counts - steps * rate) ** 2 / (steps * rate * (1 - rate)))
    p_value = stats.chi2.sf(statistic, df=SOURCE_SIZE)
    assert 0.001 < p_value < 0.999, (statistic, p_value)
    # And the union's batch size over steps has the Binomial(N, q) mean: checked through the total count.
    standard_error = np.sqrt(SOURCE_SIZE * rate * (1 - rate) * steps)
    assert abs(counts.sum() - steps * SOURCE_SIZE * rate) < 4 * standard_error


def test_the_counts_of_different_shards_are_independent():
    # Pearson correlation of two shards' per-step counts over 4000 steps: |r| < 4/sqrt(steps) when independent.
    rate, steps = 0.05, 4000
    counts = np.array([union_sample(33, step, rate)[1] for step in range(steps)])
    for first, second in ((0, 1), (0, 2), (1, 2)):
        correlation = np.corrcoef(counts[:, first], counts[:, second])[0, 1]
        assert abs(correlation) < 4 / np.sqrt(steps), (first, second, correlation)


def test_a_seeded_stream_replays_and_differs_by_shard_worker_and_step():
    def draw(shard, worker, step):
        return local_poisson_sample(local_sampling_key(4, shard, worker), step, 10_000, 0.3)

    assert np.array_equal(draw(1, 0, 5), draw(1, 0, 5))
    for other in (draw(2, 0, 5), draw(1, 1, 5), draw(1, 0, 6)):
        assert not np.array_equal(draw(1, 0, 5), other)


def test_without_a_seed_each_worker_replays_under_its_own_key_and_a_new_worker_draws_fresh():
    key = local_sampling_key(None, 1, 0)
    assert np.array_equal(local_poisson_sample(key, 5, 10_000, 0.3), local_poisson_sample(key, 5, 10_000, 0.3))
    # A replacement worker (or a resumed run) draws a new key from OS entropy: a fresh sample for the same step.
    assert not np.array_equal(local_poisson_sample(key, 5, 10_000, 0.3),
                              local_poisson_sample(local_sampling_key(None, 1, 0), 5, 10_000, 0.3))


def test_two_workers_of_a_shard_hold_its_examples_once_each_and_sample_only_their_own():
    shard = ShardSpec("mnist", 1, 100, workers=2)
    workers = [ShardWorker(shard, 1, worker, 9, "gdp_cnn", 16) for worker in range(2)]
    images, labels = load_split("mnist", "train")
    start, stop = part_bounds(len(labels), 1, 100)
    assert sum(worker.example_count() for worker in workers) == stop - start == 600
    assert torch.equal(torch.cat([worker.source.labels for worker in workers]), labels[start:stop])
    assert torch.equal(torch.cat([worker.source.inputs for worker in workers]), images[start:stop])
    worker = workers[1]
    worker.set_sampling_rate(0.05)
    weights = torch.nn.utils.parameters_to_vector(worker.model.parameters()).detach().numpy()
    answer = worker.sampled_clipped_grad_sum(weights, 7, 1.0)
    indices = local_poisson_sample(local_sampling_key(9, 1, 1), 7, 300, 0.05)
    assert indices.size > 0
    np.testing.assert_array_equal(answer, worker.clipped_grad_sum(weights, indices, 1.0, count_zeroed=True))
    assert answer.size == weights.size + 1  # the sum and one raw count; no index or batch size


SHARDED = dict(steps=3, noise_multiplier=1.0, batch_size=30,
               shards=[{"part": 0, "parts": 2, "resources": {"silo-a": 1}},
                       {"part": 1, "parts": 2, "resources": {"silo-b": 1}, "workers": 2}])


@pytest.mark.parametrize("extra, message", [
    ({"microbatch_size": 4}, "microbatch_size cannot be combined with shards"),
    ({"adaptive_clipping": True}, "adaptive_clipping cannot be combined with shards"),
    ({"train_subset": 100}, "train_subset cannot be combined with shards"),
    ({"workers": 2}, "each shard's workers set the run's workers (3 in all"),
    ({"shards": [{"part": 0, "parts": 2}, {"part": 1, "parts": 3}]}, "shards 0 and 1 overlap in 'mnist'"),
    ({"shards": [{"part": 2, "parts": 2}]}, "shards[0].part must be in 0..1"),
    ({"shards": [{"resources": {"silo-a": 0}}]}, "shards[0].resources.silo-a must be > 0"),
    ({"shards": [{"rows": 5}]}, "shards[0] has unknown key(s) rows"),
    ({"shards": {"part": 0}}, "shards must be a list of tables"),
    ({"on_shard_loss": "retry"}, "on_shard_loss must be one of wait, skip"),
    ({"shards": None, "on_shard_loss": "skip"}, "on_shard_loss applies only to a config with shards"),
])
def test_bad_shard_configs_are_refused_naming_the_key(extra, message):
    with pytest.raises(UsageError) as error:
        build_config({**SHARDED, **extra})
    assert message in str(error.value)


def test_a_sharded_config_counts_its_workers_and_is_planned_on_the_reported_n():
    config = build_config(SHARDED)
    assert config.workers == 3 and config.on_shard_loss == "wait" and config.shard_timeout == 300.0
    plan = plan_run(config, dataset_size=60_000)
    assert plan.dataset_size == 60_000 and plan.sampling_rate == 30 / 60_000 and plan.expected_batch_size == 30
    with pytest.raises(UsageError, match=r"batch_size \(30\) must not exceed the dataset size \(20\)"):
        plan_run(config, dataset_size=20)
    assert build_config(json.loads(json.dumps(config.to_dict()))) == config  # as --resume reads config.json


def test_the_printed_summary_names_the_steps_each_lost_worker_missed():
    outages = [{"shard": 2, "worker": 0, "workers": 1, "resources": {"silo-c": 1.0}, "first_step": 4, "last_step": 5},
               {"shard": 0, "worker": 1, "workers": 2, "resources": {"silo-a": 1.0}, "first_step": 9, "last_step": 9}]
    assert outage_rows(outages) == [["ran without shard 2 ({'silo-c': 1.0})", "steps 4-5"],
                                    ["ran without shard 0 worker 1 of 2 ({'silo-a': 1.0})", "step 9"]]
