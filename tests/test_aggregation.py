"""Partial sums added on each node: a real Ray cluster of two nodes on loopback, two gradient workers on each.

The head has no CPUs, so every worker runs on a node other than the driver's
and each node's two sums are added by its reducer before they reach the driver.
"""

import io
from types import SimpleNamespace

import numpy as np
import pytest
import ray
from servers import start_loopback_cluster, stop_loopback_cluster

from orchestrator.aggregation import NodeAggregation
from orchestrator.config import build_config
from orchestrator.trainer import Trainer
from workers.models import build_model, flat_parameters

NODES = ("node-a", "node-b")
WORKERS_PER_NODE = 2


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs and two nodes of two CPUs each."""
    cluster, _ = start_loopback_cluster([dict(num_cpus=WORKERS_PER_NODE, resources={node: WORKERS_PER_NODE})
                                         for node in NODES])
    yield cluster
    stop_loopback_cluster(cluster)


def test_each_nodes_sums_are_added_there_and_equal_the_flat_float64_sum(cluster, worker_pool, tmp_path):
    # The workers the training runs below are then handed: one CPU each, so two on each node.
    run = SimpleNamespace(config=config(tmp_path, "sums"), planned_dataset=None)
    workers = {index: worker_pool.worker_for(run) for index in range(len(NODES) * WORKERS_PER_NODE)}
    nodes = dict(zip(workers, ray.get([worker.node_id.remote() for worker in workers.values()])))
    assert len(set(nodes.values())) == len(NODES)
    aggregation = NodeAggregation()
    aggregation.place(workers, nodes)
    assert set(aggregation.reducers) == set(nodes.values())
    weights_vector = flat_parameters(build_model("gdp_cnn")).numpy()
    weights = ray.put(weights_vector)
    shards = np.array_split(np.random.default_rng(2).choice(300, size=48, replace=False), len(workers))
    calls = {index: (shards[index], 0.5) for index in workers}
    gathered = aggregation.gather(aggregation.run(workers, nodes, "clipped_grad_sum", weights, calls,
                                                  {"count_zeroed": True}))
    # One float64 buffer per node reaches the driver: nodes x (parameters + the zeroed count) values.
    assert gathered.failed == [] and len(gathered.parts) == len(NODES)
    assert all(part.dtype == np.float64 for part in gathered.parts)
    assert gathered.values_in == len(NODES) * (weights_vector.size + 1)
    assert 0 < gathered.slowest_worker_seconds <= gathered.wait_seconds
    flat = ray.get([workers[index].clipped_grad_sum.remote(weights, *calls[index], count_zeroed=True)
                    for index in workers])
    expected = np.add.reduce(flat, dtype=np.float64)
    np.testing.assert_allclose(np.add.reduce(gathered.parts), expected, rtol=1e-12, atol=1e-12)
    # The weights went out once, as one object: each worker node holds its copy of it.
    holders = ray.experimental.get_object_locations([weights])[weights]["node_ids"]
    assert set(nodes.values()) <= set(holders)
    aggregation.close()


def config(tmp_path, name):
    return build_config(dict(
        dataset="mnist", model="gdp_cnn", workers=len(NODES) * WORKERS_PER_NODE, steps=4, batch_size=60,
        train_subset=600, test_subset=100, noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.5, seed=5,
        run_dir=str(tmp_path / name), max_physical_batch=32, optimizer={"name": "momentum"},
    ))


class CountingTrainer(Trainer):
    """A trainer that notes, per step, how many buffers and values of partial sums the driver received."""

    def _step(self, workers):
        super()._step(workers)
        self.received = getattr(self, "received", []) + [(len(self.gathered.parts), self.gathered.values_in)]


class LoseWorkerBeforeStep(CountingTrainer):
    """A trainer whose worker 0 is killed for good just before step 3: its node's reducer fails that step."""

    def _partial_sums(self, workers, weights, shards, group_shards, next_shards):
        if self.step == 2 and not getattr(self, "killed", False):
            self.killed = True
            ray.kill(workers[0], no_restart=True)
        return super()._partial_sums(workers, weights, shards, group_shards, next_shards)


def test_training_receives_one_buffer_per_node_and_a_lost_worker_changes_no_weight(cluster, worker_pool, tmp_path):
    # The reduced sums equal the flat float64 sums (the test above); here the trainer receives them node by node.
    reduced = CountingTrainer(config(tmp_path, "reduced"), show_progress=False, out=io.StringIO())
    reduced.run()
    parameters = flat_parameters(reduced.model).numel()
    assert reduced.received == [(len(NODES), len(NODES) * (parameters + 1))] * 4
    disturbed = LoseWorkerBeforeStep(config(tmp_path, "disturbed"), show_progress=False, out=io.StringIO())
    disturbed.run()
    assert "worker 0 is gone; replacing it and recomputing its shard" in disturbed.out.getvalue()
    # In step 3, node b's sum arrives as usual and node a's workers are called one by one; step 4 is reduced again.
    assert disturbed.received[2][0] == 1 + WORKERS_PER_NODE and disturbed.received[3][0] == len(NODES)
    np.testing.assert_allclose(flat_parameters(disturbed.model), flat_parameters(reduced.model), atol=1e-6, rtol=0)
