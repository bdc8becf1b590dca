"""The collective path on a real Ray cluster of two nodes on loopback: one rank on each, over gloo.

The head has no CPUs, so each rank runs on a node of its own and the
reduce-scatter and all-gather cross between them. Every test shares the
module's cluster, and runs that set up the same thing are made once, in
module fixtures, and asserted on by each test that needs them. The
fine-tuning tests, last, add a third node and fine-tune a tiny pretrained
decoder on three ranks.
"""

import io
import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest
import ray
from hypothesis import given
from hypothesis import strategies as st
from servers import add_loopback_node, start_loopback_cluster, stop_loopback_cluster

from orchestrator.collective import AUTO_COLLECTIVE_FROM, kept_on_driver_by_planned_batches, resolved_aggregation
from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.trainer import Trainer, resume_trainer
from workers.collective import slice_bounds
from workers.models import flat_parameters

NODES = 2


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs and two nodes of one CPU each."""
    cluster, _ = start_loopback_cluster([dict(num_cpus=1) for _ in range(NODES)])
    yield cluster
    stop_loopback_cluster(cluster)


def tiny_config(tmp_path, name, **overrides):
    values = dict(
        dataset="mnist", model="bench.mlp:mlp_tiny", workers=NODES, steps=3, batch_size=40, train_subset=400,
        test_subset=100, noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.05, seed=3,
        optimizer={"name": "adam"}, run_dir=str(tmp_path / name), max_physical_batch=64,
    )
    values.update(overrides)
    return build_config(values)


class NoiseOff(Trainer):
    """A seeded run with no noise (tests only): the sums alone move the weights, on either path."""

    def _noise_std(self, step, clip_norm):
        return 0.0


class RanksAgree(NoiseOff):
    """A noiseless run that fetches every rank's weights after each step and keeps whether they were identical."""

    def _step(self, workers):
        super()._step(workers)
        weights = ray.get([worker.current_weights.remote() for worker in workers])
        self.identical = getattr(self, "identical", []) + [all(np.array_equal(weights[0], other)
                                                                for other in weights[1:])]


def run(trainer_class, config):
    """`trainer_class`'s run of `config`: the trainer (with its `initial_weights`, before any step) and summary."""
    trainer = trainer_class(config, show_progress=False, out=io.StringIO())
    trainer.initial_weights = flat_parameters(trainer.model).clone()
    summary = trainer.run()
    return trainer, summary


def assert_same_weights(first, second):
    np.testing.assert_allclose(flat_parameters(first.model).numpy(), flat_parameters(second.model).numpy(),
                               rtol=1e-5, atol=1e-6)
    # The runs trained: the agreement is not that of two untouched models.
    assert (flat_parameters(first.model) - first.initial_weights).abs().max() > 1e-3


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_slices_cover_every_coordinate_exactly_once(size, world_size):
    owners = np.zeros(size, dtype=int)
    for start, stop in slice_bounds(size, world_size):
        owners[start:stop] += 1
    assert (owners == 1).all()
    # Equal lengths but the trailing ones: what reduce-scatter pads to.
    lengths = [stop - start for start, stop in slice_bounds(size, world_size)]
    assert lengths == sorted(lengths, reverse=True) and max(lengths) == -(-size // world_size)


# Two silos of 3,000 MNIST examples each (a twentieth of the training split apiece: quick to load).
SILOS = [{"dataset": "mnist", "part": part, "parts": 20} for part in range(NODES)]


def test_collective_refuses_what_it_does_not_run(tmp_path):
    # Parameter averaging, user-level privacy and DP-FedAvg run on it.
    tiny_config(tmp_path, "ema", aggregation="collective", ema_decay=0.9)
    tiny_config(tmp_path, "users", aggregation="collective", privacy_unit="user", synthetic_users=40, batch_size=8)
    tiny_config(tmp_path, "fedavg", aggregation="collective", **ONE_USER_STEP, **FEDAVG)
    with pytest.raises(UsageError, match='on_shard_loss = "skip"'):
        tiny_config(tmp_path, "skip", aggregation="collective", shards=SILOS, train_subset=None,
                    on_shard_loss="skip")
    assert tiny_config(tmp_path, "auto").aggregation == "auto"


def test_auto_picks_the_collective_path_from_the_measured_crossover(tmp_path):
    config = tiny_config(tmp_path, "auto")  # 2 workers
    assert resolved_aggregation(config, AUTO_COLLECTIVE_FROM // 2) == "collective"
    assert resolved_aggregation(config, AUTO_COLLECTIVE_FROM // 2 - 1) == "driver"
    # One worker has no sum to share: the driver path, however large the model.
    assert resolved_aggregation(tiny_config(tmp_path, "one", workers=1), 10 ** 9) == "driver"
    # A config the collective path does not run stays on the driver path.
    skip = tiny_config(tmp_path, "skip", shards=SILOS, train_subset=None, on_shard_loss="skip")
    assert resolved_aggregation(skip, 10 ** 9) == "driver"
    assert resolved_aggregation(tiny_config(tmp_path, "named", aggregation="driver"), 10 ** 9) == "driver"
    # Planned batches keep it on the driver path, and say so only where the size would have chosen the collective.
    assert resolved_aggregation(config, 10 ** 9, planned=True) == "driver"
    assert kept_on_driver_by_planned_batches(config, 10 ** 9, planned=True)
    assert not kept_on_driver_by_planned_batches(config, AUTO_COLLECTIVE_FROM // 2 - 1, planned=True)
    assert not kept_on_driver_by_planned_batches(config, 10 ** 9, planned=False)
    assert not kept_on_driver_by_planned_batches(skip, 10 ** 9, planned=True)


def test_silo_mode_on_the_collective_path_gives_the_driver_paths_weights(cluster, tmp_path):
    # Each shard's rank samples its own examples from a key of (seed, shard, worker) on both paths.
    options = dict(shards=SILOS, train_subset=None, steps=3)
    driver, driver_summary = run(NoiseOff, tiny_config(tmp_path, "driver", aggregation="driver", **options))
    collective, summary = run(NoiseOff, tiny_config(tmp_path, "collective", aggregation="collective", **options))
    assert_same_weights(collective, driver)
    assert summary["epsilon"] == driver_summary["epsilon"] and summary["dataset_size"] == 6_000
    # No index leaves a silo on either path; on this one no vector of P values passes the driver either.
    assert collective.record.times.driver_bytes_per_step() < 64 * 1024 < driver.record.times.driver_bytes_per_step()
    # The driver's traffic counts the sample's indices: it stays in memory, out of the summary (rule 3).
    assert "driver_bytes_per_step" not in summary


# With parameter averaging: each rank keeps the average of its slice, the driver path that of the whole.
AVERAGED = dict(ema_decay=0.9)


@pytest.fixture(scope="module")
def both_paths(cluster, tmp_path_factory):
    """Noiseless seeded AVERAGED runs of the tiny model on the driver path and on the collective path."""
    folder = tmp_path_factory.mktemp("paths")
    return (run(NoiseOff, tiny_config(folder, "driver", aggregation="driver", **AVERAGED)),
            run(RanksAgree, tiny_config(folder, "collective", aggregation="collective", **AVERAGED)))


def test_collective_gives_the_driver_paths_weights_and_average_and_ranks_agree_each_step(both_paths):
    (driver, driver_summary), (collective, summary) = both_paths
    # Adam's state is held a slice per rank (ZeRO-1); the weights still match the whole-vector optimizer's.
    assert_same_weights(collective, driver)
    assert collective.identical == [True] * 3
    # The moving average, kept slice by slice on the ranks, is the driver path's, and is what was evaluated.
    np.testing.assert_allclose(collective.ema_weights.numpy(), driver.ema_weights.numpy(), rtol=1e-5, atol=1e-6)
    assert (collective.ema_weights - flat_parameters(collective.model)).abs().max() > 1e-3
    assert collective.record.metrics[-1]["test_loss"] == pytest.approx(driver.record.metrics[-1]["test_loss"],
                                                                       rel=1e-5)
    assert summary["epsilon"] == driver_summary["epsilon"]
    assert collective.record.times.driver_bytes_per_step() < 64 * 1024
    # The driver path moves the weights and the sums through the driver; the collective path does not.
    assert driver.record.times.driver_bytes_per_step() > 3 * 4 * collective.flat_weights.numel()


def test_driver_bytes_per_step_do_not_grow_with_the_model(both_paths, tmp_path):
    tiny = both_paths[1][0]
    small = run(NoiseOff, tiny_config(tmp_path, "small", aggregation="collective", model="bench.mlp:mlp_small",
                                      **AVERAGED))[0]
    # Eight times the parameters, the same sample and scalars: the same bytes.
    assert small.record.times.driver_bytes_per_step() == tiny.record.times.driver_bytes_per_step()


# User level, one SGD step: the driver samples users and each rank clips each of its users' rows whole
# (GradientWorker.user_clipped_sum). After one step from the same seed, a noisy run's weights differ from a quiet
# run's by lr * noise / (q N), coordinate by coordinate.
ONE_USER_STEP = dict(privacy_unit="user", synthetic_users=40, batch_size=8, steps=1, optimizer="sgd",
                     learning_rate=1.0, noise_multiplier=2.0, clip_norm=0.5)
# DP-FedAvg: each user's clipped model delta after local SGD, which the server optimizer applies.
FEDAVG = dict(local_steps=2, local_learning_rate=0.1)


@pytest.fixture(scope="module")
def quiet_user_step(cluster, tmp_path_factory):
    """ONE_USER_STEP without noise on the collective path: its trainer and summary."""
    return run(NoiseOff, tiny_config(tmp_path_factory.mktemp("quiet"), "quiet", aggregation="collective",
                                     **ONE_USER_STEP))


def test_user_level_on_the_collective_path_gives_the_driver_paths_weights(quiet_user_step, tmp_path):
    collective, summary = quiet_user_step
    driver, driver_summary = run(NoiseOff, tiny_config(tmp_path, "driver", aggregation="driver", **ONE_USER_STEP))
    assert_same_weights(collective, driver)
    assert summary["privacy_unit"] == "user" and summary["users"] == driver_summary["users"] == 40
    assert summary["epsilon"] == driver_summary["epsilon"]
    assert collective.record.times.driver_bytes_per_step() < 64 * 1024


def test_dp_fedavg_on_the_collective_path_gives_the_driver_paths_weights(cluster, tmp_path):
    steps = dict(ONE_USER_STEP, steps=2, **FEDAVG)
    collective, _ = run(NoiseOff, tiny_config(tmp_path, "collective", aggregation="collective", **steps))
    driver, _ = run(NoiseOff, tiny_config(tmp_path, "driver", aggregation="driver", **steps))
    assert_same_weights(collective, driver)


def test_each_coordinate_gets_noise_of_std_sigma_c_once(quiet_user_step, tmp_path):
    quiet, _ = quiet_user_step
    noisy, _ = run(Trainer, tiny_config(tmp_path, "noisy", aggregation="collective", **ONE_USER_STEP))
    noise = ((flat_parameters(quiet.model) - flat_parameters(noisy.model)).double().numpy()
             * noisy.plan.contributions_per_step)
    std = 2.0 * 0.5
    assert (noise != 0).all()  # no coordinate left un-noised
    # Each rank's slice on its own: a slice noised twice would have std sqrt(2) sigma C (a 41% excess).
    for start, stop in slice_bounds(noise.size, NODES):
        assert noise[start:stop].std() == pytest.approx(std, rel=0.05)
        assert abs(noise[start:stop].mean()) < 4 * std / np.sqrt(stop - start)
    # The slices' noise is independent: no slice repeats another's.
    (first, second) = (noise[start:stop] for start, stop in slice_bounds(noise.size, NODES))
    assert abs(np.corrcoef(first[:second.size], second)[0, 1]) < 0.06


# Seeded, so that a resumed and disturbed run draws the same samples and noise as the whole run. Adaptive
# clipping's noisy count runs on the driver, and moves the clip norm that the steps are sent. The ranks' slices
# of the moving average are restored with their optimizer slices.
WHOLE_RUN = dict(aggregation="collective", steps=6, checkpoint_every=2,
                 adaptive_clipping={"target_quantile": 0.5, "count_noise_multiplier": 3.0}, **AVERAGED)


class LeavesAStoppedCopy(Trainer):
    """A trainer that copies its run folder, as its checkpoint of step 2 leaves it, to `run_dir` + "-stopped":
    the folder of a run stopped there."""

    def _save_checkpoint(self):
        super()._save_checkpoint()
        if self.step == 2:
            shutil.copytree(self.config.run_dir, self.config.run_dir + "-stopped")


@pytest.fixture(scope="module")
def whole_run(cluster, tmp_path_factory):
    """The seeded WHOLE_RUN, undisturbed: its trainer and summary (and the copy it leaves of step 2)."""
    return run(LeavesAStoppedCopy, tiny_config(tmp_path_factory.mktemp("whole"), "whole", **WHOLE_RUN))


class RemoveRankNodeMidStep(Trainer):
    """A trainer that removes, without grace, the node of rank `victim` just as step `at_step` is sent out."""

    at_step, victim, cluster = 5, 0, None

    def _collective_step(self, workers):
        if self.step == self.at_step and not getattr(self, "removed", False):
            self.removed = True
            node_id = ray.get(workers[self.victim].node_id.remote())
            (node,) = [node for node in self.cluster.worker_nodes if node.node_id == node_id]
            pid = int(ray.get(workers[self.victim].ping.remote()).rsplit(":", 1)[1])

            def node_dies():
                # The rank's process first, so that it dies within the step for certain; then the rest of its node.
                os.kill(pid, signal.SIGKILL)
                self.cluster.remove_node(node, allow_graceful=False)

            threading.Timer(0.001, node_dies).start()
        super()._collective_step(workers)


def test_a_resumed_run_restores_each_ranks_slices_and_one_whose_rank_dies_mid_step_ends_as_the_whole_run(
        cluster, whole_run):
    # Last but the fine-tuning tests: it leaves the cluster with a node of its own in place of the removed one.
    whole, whole_summary = whole_run
    add_loopback_node(cluster, num_cpus=1)  # where the replacement rank goes
    # Resumed from step 2, it checkpoints step 4 and loses a rank's node in step 5. It only ends where the whole
    # run does when each rank got its Adam state and average back, at the resumption and again after the loss.
    resumed = resume_trainer(whole.config.run_dir + "-stopped", RemoveRankNodeMidStep, show_progress=False,
                             out=io.StringIO())
    assert resumed.step == 2 and len(resumed.optimizer_slices) == NODES
    resumed.cluster = cluster
    summary = resumed.run()
    log = resumed.out.getvalue()
    assert resumed.removed and resumed.fleet.replacements == 1
    # Lost in step 5: the group restarts from the checkpoint of step 4 and runs step 4 again, then step 5.
    assert "step 5: collective rank(s) [0] lost" in log and "the 1 step(s) since the restore point at step 4" in log
    assert log.count("collective path: 2 ranks over gloo") == 2
    # The replayed step was sent the clip norm it had, not the one adaptive clipping had moved to since.
    assert summary["steps"] == whole_summary["steps"] == 6 and summary["epsilon"] == whole_summary["epsilon"]
    assert resumed.record.clip_norm == whole.record.clip_norm != 1.0
    np.testing.assert_allclose(flat_parameters(resumed.model), flat_parameters(whole.model), atol=1e-6, rtol=0)
    np.testing.assert_allclose(resumed.ema_weights, whole.ema_weights, atol=1e-6, rtol=0)


# --- fine-tuning a tiny pretrained decoder on three nodes -----------------------------------------------------------
# Noiseless seeded runs (tests only): with a LoRA adapter the collective path gives the driver path's weights; with
# full fine-tuning every rank holds the same weights after each step, and they moved.

FINE_TUNING_RANKS = 3
TOKENS = 10


@pytest.fixture(scope="module")
def fine_tuning(cluster, tmp_path_factory):
    """A third node of one CPU, a tiny Llama's folder and its token data: what a fine-tuning config is made of."""
    pytest.importorskip("peft")
    from test_pretrained import save_tiny_models, token_table

    add_loopback_node(cluster, num_cpus=1)  # the module's two nodes, or the resumption test's survivor and its own
    wait_for_free_cpus(FINE_TUNING_RANKS)
    folder = tmp_path_factory.mktemp("fine-tuning")
    return folder, save_tiny_models(str(folder / "models"))["llama"], {
        "format": "parquet", "train": token_table(folder / "train.parquet", 120, TOKENS, 1),
        "test": token_table(folder / "test.parquet", 30, TOKENS, 2)}


def wait_for_free_cpus(count: int, seconds: float = 60.0) -> None:
    """Wait until the cluster's live nodes have `count` CPUs free: a removed node's are no longer counted."""
    deadline = time.monotonic() + seconds
    while ray.available_resources().get("CPU", 0) < count:
        assert time.monotonic() < deadline, f"the cluster never had {count} CPUs free: {ray.available_resources()}"
        time.sleep(0.2)


def fine_tuning_config(fine_tuning, name, **overrides):
    folder, model, dataset = fine_tuning
    values = dict(
        model={"hf": model, "task": "sequence-classification", "num_labels": 2}, dataset=dataset,
        workers=FINE_TUNING_RANKS, steps=2, batch_size=30, noise_multiplier=1.0, clip_norm=0.5, learning_rate=0.5,
        seed=3, run_dir=str(folder / name), max_physical_batch=16, plan_ahead_steps="off",
    )
    values.update(overrides)
    return build_config(values)


def test_the_collective_path_fine_tunes_a_lora_adapter_like_one_worker_on_the_driver_path(fine_tuning):
    adapter = {"kind": "lora", "r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}
    driver, _ = run(NoiseOff, fine_tuning_config(fine_tuning, "lora-driver", aggregation="driver", workers=1,
                                                 adapter=adapter))
    collective, _ = run(NoiseOff, fine_tuning_config(fine_tuning, "lora-collective", aggregation="collective",
                                                     adapter=adapter))
    assert (driver.aggregation, collective.aggregation) == ("driver", "collective")
    weights = flat_parameters(collective.model)
    np.testing.assert_allclose(weights.numpy(), flat_parameters(driver.model).numpy(), rtol=1e-4, atol=1e-6)
    assert (weights - collective.initial_weights).abs().max() > 1e-4
    assert weights.numel() < 2_000  # the adapter's factors and the new head, not the frozen base


def test_the_collective_path_carries_full_fine_tuning_with_every_rank_in_step(fine_tuning):
    trainer, _ = run(RanksAgree, fine_tuning_config(fine_tuning, "full-collective", aggregation="collective"))
    assert trainer.aggregation == "collective"
    assert f"collective path: {FINE_TUNING_RANKS} ranks over gloo" in trainer.out.getvalue()
    weights = flat_parameters(trainer.model)
    assert trainer.identical == [True, True]
    assert weights.numel() > 5_000 and bool(weights.isfinite().all())
    assert (weights - trainer.initial_weights).abs().max() > 1e-4
