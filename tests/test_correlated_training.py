"""Correlated-noise mechanisms end to end: config refusals, their samplers, the driver's noise and a real Ray run."""

from __future__ import annotations

import numpy as np
import pytest

from accounting.accountants import get_accountant
from accounting.events import CorrelatedGaussian
from accounting.matrix_mechanisms import CorrelatedNoisePlan, band_coefficients, banded_inverse_noise, tree_nodes
from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.noise import GRADIENT_NOISE, TREE_NOISE, CentralNoise, GaussianNoise
from orchestrator.planning import plan_run
from orchestrator.sampling import correlated_step_sample, shuffled_order
from orchestrator.trainer import Trainer
from workers.keys import ORDER, SecretKey
from workers.sampling import SiloFixedOrder, silo_fixed_order_batch
from workers.shard_spec import ShardSpec
from workers.shard_worker import ShardWorker


@pytest.fixture(autouse=True)
def strategy_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFLEET_CACHE_DIR", str(tmp_path / "cache"))
    band_coefficients.cache_clear()


def config_of(tmp_path, **overrides):
    values = dict(
        dataset="mnist", model="gdp_cnn", workers=2, steps=6, batch_size=60, train_subset=600, test_subset=200,
        noise_multiplier=1.1, clip_norm=1.0, learning_rate=0.5, seed=13, run_dir=str(tmp_path / "run"),
        max_physical_batch=64,
    )
    values.update(overrides)
    # An override of None leaves the key out (shards take the place of train_subset and workers).
    return build_config({name: value for name, value in values.items() if value is not None})


@pytest.mark.parametrize("overrides,message", [
    (dict(mechanism="band-mf"), 'choose sampler = "cyclic-poisson"'),
    (dict(mechanism="dp-ftrl", sampler="cyclic-poisson"), 'needs sampler = "fixed-order"'),
    (dict(sampler="fixed-order"), 'needs sampler = "poisson"'),
    (dict(band_width=4), 'band_width applies to mechanism = "band-mf"'),
    (dict(mechanism="band-mf", sampler="fixed-order", microbatch_size=4), "cannot be combined with microbatch_size"),
    (dict(mechanism="dp-ftrl", sampler="fixed-order", noise_schedule="exponential"),
     "a noise_schedule other than constant"),
])
def test_a_sampler_or_key_that_does_not_match_the_mechanism_is_refused_with_the_reason(tmp_path, overrides, message):
    with pytest.raises(UsageError, match=message):
        config_of(tmp_path, **overrides)


def test_band_wider_than_an_epoch_or_than_the_groups_allow_is_refused_at_planning(tmp_path):
    with pytest.raises(UsageError, match="at most the steps of one epoch, 10"):
        plan_run(config_of(tmp_path, mechanism="band-mf", sampler="fixed-order", band_width=11, steps=30))
    with pytest.raises(UsageError, match="band_width·batch_size must be at most N = 600"):
        plan_run(config_of(tmp_path, mechanism="band-mf", sampler="cyclic-poisson", band_width=11))


def test_fixed_order_takes_each_example_once_per_epoch_and_cyclic_poisson_one_group_a_step():
    key = SecretKey.from_seed(3)
    order = shuffled_order(key, 100)
    fixed = CorrelatedNoisePlan("band-mf", "fixed-order", 20, 10, band_width=2)
    epoch = [correlated_step_sample(key, order, step, fixed, 10) for step in range(10)]
    assert np.array_equal(np.sort(np.concatenate(epoch)), np.arange(100))
    assert np.array_equal(correlated_step_sample(key, order, 13, fixed, 10), epoch[3])
    cyclic = CorrelatedNoisePlan("band-mf", "cyclic-poisson", 400, 10, band_width=4, participation_rate=0.4)
    groups = [set(order[group * 25:(group + 1) * 25]) for group in range(4)]
    sizes = []
    for step in range(400):
        batch = correlated_step_sample(key, order, step, cyclic, 10)
        assert set(batch) <= groups[step % 4]
        sizes.append(len(batch))
    # Binomial(25, 0.4) batches: mean 10, variance 6; over 400 steps the mean is within 4 standard errors of 10.
    assert abs(np.mean(sizes) - 10) < 4 * np.sqrt(6 / 400)
    assert np.var(sizes) > 3


def test_a_silo_worker_takes_each_of_its_examples_once_an_epoch_in_an_order_its_replacement_shares():
    key = SecretKey.from_seed(3)
    fixed = SiloFixedOrder(key.derive(ORDER, 1, 0), 7)
    # No seed: the worker's own sampling key is fresh, as a replacement's is; the order is the driver's.
    worker = ShardWorker(ShardSpec("mnist", 1, 500), 1, 0, None, "gdp_cnn", 16)
    worker.set_sampling_rate(60 / 360, 14, fixed)
    order = fixed.order(120)
    epochs = [[worker._local_sample(step) for step in range(epoch * 7, (epoch + 1) * 7)] for epoch in range(2)]
    assert np.array_equal(np.sort(np.concatenate(epochs[0])), np.arange(120))
    assert [len(batch) for batch in epochs[0]] == [17, 17, 17, 17, 17, 17, 18]
    for step, batch in enumerate(epochs[0]):
        assert np.array_equal(batch, epochs[1][step])
        assert np.array_equal(batch, silo_fixed_order_batch(order, step, 7))
    # Another slot's key gives another order; the key stays out of the record's repr.
    assert not np.array_equal(SiloFixedOrder(key.derive(ORDER, 2, 0), 7).order(120), order)
    assert repr(fixed) == "SiloFixedOrder(steps_per_epoch=7)"


def test_with_shards_correlated_noise_needs_fixed_order_participation(tmp_path):
    shards = [{"dataset": "mnist", "part": part, "parts": 2, "resources": {f"silo-{part}": 1}} for part in range(2)]
    with pytest.raises(UsageError, match='with shards, mechanism = "band-mf" runs fixed-order participation'):
        config_of(tmp_path, train_subset=None, workers=None, shards=shards, mechanism="band-mf",
                  sampler="cyclic-poisson")
    config = config_of(tmp_path, train_subset=None, workers=None, shards=shards, mechanism="dp-ftrl",
                       sampler="fixed-order")
    assert config.mechanism == "dp-ftrl" and len(config.shards) == 2


def test_band_mf_noise_is_row_t_of_the_inverse_applied_to_dp_sgds_vectors():
    plan = CorrelatedNoisePlan("band-mf", "fixed-order", 8, 8, band_width=3)
    noise = GaussianNoise(SecretKey.from_seed(4), threads=1)
    central = CentralNoise(noise, 7, 8, plan)
    try:
        released = np.array([np.array(central.take(step)) for step in range(8)])
    finally:
        central.close()
    independent = np.array([noise.draw(7, 1.0, (GRADIENT_NOISE, step)) for step in range(8)])
    assert np.allclose(released, banded_inverse_noise(plan.coefficients, independent), atol=1e-12)
    with pytest.raises(RuntimeError, match="already taken"):
        central.take(7)


def test_one_band_releases_dp_sgds_own_noise_vectors():
    plan = CorrelatedNoisePlan("band-mf", "cyclic-poisson", 5, 5, band_width=1, participation_rate=0.1)
    central = CentralNoise(GaussianNoise(SecretKey.from_seed(4), threads=1), 9, 5, plan)
    plain = CentralNoise(GaussianNoise(SecretKey.from_seed(4), threads=1), 9, 5)
    try:
        for step in range(5):
            assert np.array_equal(np.array(central.take(step)), np.array(plain.take(step)))
    finally:
        central.close()
        plain.close()


@pytest.mark.parametrize("restart,complete", [(True, False), (True, True), (False, False)])
def test_dp_ftrl_noise_adds_up_to_each_prefixs_tree_nodes(restart, complete):
    plan = CorrelatedNoisePlan("dp-ftrl", "fixed-order", 14, 5, tree_restart=restart, tree_completion=complete)
    noise = GaussianNoise(SecretKey.from_seed(6), threads=1)
    central = CentralNoise(noise, 4, 14, plan)
    try:
        released = [np.array(central.take(step)) for step in range(14)]
    finally:
        central.close()
    leaves = 5 if restart else 14
    for step in range(14):
        tree, position = divmod(step, leaves)
        tree_leaves = min(leaves, 14 - tree * leaves)
        expected = sum(noise.draw(4, 1.0, (TREE_NOISE, tree, *node))
                       for node in tree_nodes(position, tree_leaves, complete))
        assert np.allclose(sum(released[tree * leaves:step + 1]), expected, atol=1e-12)


@pytest.fixture
def pooled_workers(local_ray, worker_pool):
    """The module's shared Ray, whose runs take their gradient workers from the pool (`worker_pool`)."""
    return worker_pool


@pytest.mark.parametrize("mechanism,sampler,band_width", [
    ("band-mf", "cyclic-poisson", 2), ("band-mf", "fixed-order", 3), ("dp-ftrl", "fixed-order", 1)])
def test_correlated_mechanisms_train_on_local_ray_and_account_their_participations(
        pooled_workers, tmp_path, mechanism, sampler, band_width):
    # RDP: PLD's calibration of DP-SGD's σ for the summary's comparison takes most of a run (the accountants'
    # ε of these events is tested in test_matrix_mechanisms).
    config = config_of(tmp_path, mechanism=mechanism, sampler=sampler, band_width=band_width, steps=12,
                       commit_every=3, accountant="rdp", workers=1)
    trainer = Trainer(config, show_progress=False)
    summary = trainer.run()
    events = trainer.record.events
    assert all(isinstance(event, CorrelatedGaussian) and event.mechanism == mechanism for event in events.events)
    assert events == trainer.plan.planned_events
    period = band_width if sampler == "cyclic-poisson" else 10
    assert events.steps == -(-12 // period)
    assert summary["epsilon"] == pytest.approx(get_accountant("rdp").epsilon(events, config.delta))
    assert np.isfinite(summary["test_accuracy"])
    assert summary["mechanism"] == mechanism and summary["steps"] == 12
    assert summary["prefix_rmse"] == pytest.approx(trainer.plan.correlation.prefix_rmse(config.noise_multiplier))
    assert summary["dp_sgd_prefix_rmse_same_epsilon"] > 0


@pytest.mark.parametrize("overrides", [dict(commit_every=3), dict(commit_every=1), dict()])
def test_every_charged_block_of_a_correlated_run_holds_a_participation(tmp_path, overrides):
    plan = plan_run(config_of(tmp_path, mechanism="band-mf", sampler="cyclic-poisson", band_width=4, steps=30,
                              **overrides))
    starts = [0, *plan.charge_ends[:-1]]
    assert plan.charge_ends[-1] == 30
    for start, end in zip(starts, plan.charge_ends):
        assert plan.events_between(start, end).steps >= 1


def test_a_correlated_run_refuses_to_resume_and_says_why_and_what_to_do(tmp_path):
    trainer = Trainer(config_of(tmp_path, mechanism="band-mf", sampler="fixed-order", band_width=2, steps=12),
                      show_progress=False)
    state = trainer.state()
    state["step"] = 5
    with pytest.raises(UsageError) as refused:
        trainer.load_state(state)
    message = str(refused.value)
    assert 'mechanism = "band-mf" run cannot resume' in message
    assert "key held in memory only and never written" in message
    assert "The 5 of 12 steps that ran stay charged" in message and "another run_dir" in message
    assert trainer.step == 0  # nothing of the checkpoint was loaded
