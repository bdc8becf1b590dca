"""Noise schedules are accounted exactly; secure noise has the right distribution; LR schedules post-process."""

import math
import pickle
import threading

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp
from scipy import stats

from accounting.accountants import RDP_ORDERS, get_accountant
from orchestrator.config import build_config, parse_noise_schedule
from orchestrator.errors import UsageError
from orchestrator.noise import (
    CHUNK_VALUES,
    COUNT_NOISE,
    CentralNoise,
    GRADIENT_NOISE,
    GaussianNoise,
    NoiseFeed,
    TorchGaussianNoise,
)
from orchestrator.optimizers import build_lr_scheduler
from orchestrator.schedules import (
    LearningRateSchedule,
    NoiseSchedule,
    noise_blocks,
    schedule_events,
)
from orchestrator.planning import plan_run
from workers.keys import SecretKey

Q, DELTA = 0.01, 1e-5


def per_step_sigmas(blocks):
    return [sigma for sigma, steps in blocks for _ in range(steps)]


@pytest.mark.parametrize(
    "schedule, expected_first_blocks",
    [
        (NoiseSchedule("exponential", decay=0.5, every=10), [2.0, 1.0, 0.5]),
        (NoiseSchedule("step", decay=0.5, step_size=2, every=10), [2.0, 2.0, 1.0]),
        (NoiseSchedule("linear", final_ratio=0.5, every=10), [2.0, 1.5, 1.0]),
        (NoiseSchedule("constant", every=10), [2.0, 2.0, 2.0]),
    ],
)
def test_noise_blocks_follow_the_schedule(schedule, expected_first_blocks):
    blocks = noise_blocks(schedule, 2.0, 25, steps_per_epoch=100)
    assert [sigma for sigma, _ in blocks] == pytest.approx(expected_first_blocks)
    assert [steps for _, steps in blocks] == [10, 10, 5]


def test_default_block_is_one_epoch():
    blocks = noise_blocks(NoiseSchedule("exponential", decay=0.9), 1.0, 250, steps_per_epoch=100)
    assert [steps for _, steps in blocks] == [100, 100, 50]


def test_schedule_epsilon_equals_an_explicit_per_step_composition():
    blocks = noise_blocks(NoiseSchedule("exponential", decay=0.8, every=7), 1.5, 30, steps_per_epoch=100)
    events = schedule_events(blocks, Q)
    rdp_by_step = rdp.RdpAccountant(orders=RDP_ORDERS)
    pld_by_step = pld.PLDAccountant(value_discretization_interval=1e-4)
    for sigma in per_step_sigmas(blocks):
        step = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(sigma))
        rdp_by_step.compose(step)
        pld_by_step.compose(step)
    assert get_accountant("rdp").epsilon(events, DELTA) == pytest.approx(rdp_by_step.get_epsilon(DELTA), rel=1e-9)
    assert get_accountant("pld").epsilon(events, DELTA) == pytest.approx(pld_by_step.get_epsilon(DELTA), abs=2e-3)


def test_decaying_noise_costs_more_than_constant_noise():
    constant = schedule_events(noise_blocks(NoiseSchedule(), 1.2, 300, 100), Q)
    decaying = schedule_events(noise_blocks(NoiseSchedule("exponential", decay=0.8), 1.2, 300, 100), Q)
    assert get_accountant("pld").epsilon(decaying, DELTA) > get_accountant("pld").epsilon(constant, DELTA)


def test_target_epsilon_calibrates_the_whole_schedule():
    config = build_config(dict(
        steps=300, batch_size=60, train_subset=6000, target_epsilon=3.0,
        noise_schedule={"kind": "exponential", "decay": 0.8},
    ))
    plan = plan_run(config)
    assert [steps for _, steps in plan.noise_blocks] == [100, 100, 100]
    spent = get_accountant("pld").epsilon(plan.planned_events, config.delta)
    assert spent <= 3.0
    slightly_less_noise = schedule_events([(0.999 * s, n) for s, n in plan.noise_blocks], plan.sampling_rate)
    assert get_accountant("pld").epsilon(slightly_less_noise, config.delta) > 3.0
    assert plan.sigma_at(0) == plan.noise_multiplier and plan.sigma_at(150) == pytest.approx(0.8 * plan.noise_multiplier)


def test_plan_slices_events_between_steps():
    config = build_config(dict(steps=250, batch_size=60, train_subset=6000, noise_multiplier=1.0,
                               noise_schedule={"kind": "step", "decay": 0.5, "every": 100}))
    plan = plan_run(config)
    middle = plan.events_between(90, 110)
    assert [(e.noise_multiplier, e.steps) for e in middle.events] == [(1.0, 10), (0.5, 10)]
    assert plan.events_between(0, 250) == plan.planned_events


def test_bad_schedules_are_usage_errors():
    with pytest.raises(UsageError, match="noise_schedule.kind must be one of"):
        parse_noise_schedule({"kind": "cosine"})
    with pytest.raises(UsageError, match="noise_schedule.decay must be > 0"):
        parse_noise_schedule({"kind": "exponential", "decay": -1})
    with pytest.raises(UsageError, match="unknown: gamma"):
        parse_noise_schedule({"kind": "step", "gamma": 0.5})


NOISE_SOURCES = {
    "secure, numpy, 2 threads": lambda key=None: GaussianNoise(key, secure=True, threads=2),
    "plain, numpy": lambda key=None: GaussianNoise(key, secure=False),
    "secure, torch (the GPU's path, on the CPU)": lambda key=None: TorchGaussianNoise(key, True, "cpu"),
}
DRAWS = 1_000_000


@pytest.mark.parametrize("source", NOISE_SOURCES)
def test_noise_is_gaussian_with_std_sigma_c_at_a_million_draws(source):
    std = 1.95
    values = np.asarray(NOISE_SOURCES[source](SecretKey.from_seed(21)).draw(DRAWS, std, (GRADIENT_NOISE, 7)))
    assert values.dtype == np.float64 and values.shape == (DRAWS,)
    # Four standard errors of each moment at 1e6 draws.
    assert abs(values.mean()) < 4 * std / np.sqrt(DRAWS)
    assert values.std() == pytest.approx(std, rel=4 / np.sqrt(2 * DRAWS))
    assert abs(stats.skew(values)) < 4 * np.sqrt(6 / DRAWS)
    assert abs(stats.kurtosis(values)) < 4 * np.sqrt(24 / DRAWS)
    assert stats.kstest(values / std, "norm").pvalue > 1e-3


@pytest.mark.parametrize("source", NOISE_SOURCES)
def test_each_steps_noise_is_independent_of_every_other_steps(source):
    size = 3 * CHUNK_VALUES
    # A fixed seed: 24 correlations at 4 standard errors would each fail one run in 16,000 from OS entropy.
    noise = NOISE_SOURCES[source](SecretKey.from_seed(12))
    vectors = np.array([np.asarray(noise.draw(size, 1.0, (GRADIENT_NOISE, step))) for step in range(6)]
                       + [np.asarray(noise.draw(size, 1.0, (COUNT_NOISE, 0)))])
    correlations = np.corrcoef(vectors)[np.triu_indices(len(vectors), 1)]
    # 4 standard errors of a correlation of independent vectors, Bonferroni-free: 21 pairs stay well inside.
    assert np.abs(correlations).max() < 4 / np.sqrt(size)
    # Within a vector, the chunks' streams are independent too.
    chunks = vectors[0].reshape(3, CHUNK_VALUES)
    assert np.abs(np.corrcoef(chunks)[np.triu_indices(3, 1)]).max() < 4 / np.sqrt(CHUNK_VALUES)


@pytest.mark.parametrize("source", NOISE_SOURCES)
def test_one_key_replays_every_steps_noise_and_a_new_key_draws_fresh_noise(source):
    size = 2 * CHUNK_VALUES + 5
    key = SecretKey.fresh()  # OS entropy, as in production
    first = NOISE_SOURCES[source](key)
    before_crash = [np.asarray(first.draw(size, 1.3, (GRADIENT_NOISE, step))).copy() for step in range(4)]
    # Within the running driver (a worker died, the step is recomputed): the same key draws the same vector.
    again = NOISE_SOURCES[source](key)
    np.testing.assert_array_equal(np.asarray(again.draw(size, 1.3, (GRADIENT_NOISE, 2))), before_crash[2])
    # A resumed run holds a new key: every remaining step's noise is fresh.
    resumed = NOISE_SOURCES[source]()
    for step in (2, 3):
        assert not np.array_equal(np.asarray(resumed.draw(size, 1.3, (GRADIENT_NOISE, step))), before_crash[step])


def test_the_thread_count_does_not_change_the_noise():
    size = 5 * CHUNK_VALUES + 3
    key = SecretKey.from_seed(8)
    one = GaussianNoise(key, threads=1).draw(size, 1.0, (GRADIENT_NOISE, 4))
    np.testing.assert_array_equal(GaussianNoise(key, threads=3).draw(size, 1.0, (GRADIENT_NOISE, 4)), one)


def test_the_noise_key_is_never_shown_pickled_or_saved(tmp_path):
    key = SecretKey.fresh()
    noise = GaussianNoise(key)
    assert "hidden" in repr(key) and key.derive("noise").hex() not in repr(key)
    for write in (pickle.dumps, lambda value: torch.save(value, tmp_path / "state.pt")):
        with pytest.raises(TypeError, match="memory only"):
            write({"noise": noise})
    assert not hasattr(noise, "state") and not hasattr(noise, "entropy")


class ThreadRecordingNoise(GaussianNoise):
    """A noise source that notes which thread draws each key."""

    def __init__(self, seed):
        super().__init__(SecretKey.from_seed(seed))
        self.drawn_on = {}

    def draw(self, size, std, key, out=None):
        self.drawn_on[tuple(key)] = threading.current_thread().name
        return super().draw(size, std, key, out)


def test_the_feed_draws_ahead_in_the_background_and_hands_each_step_out_once():
    size = CHUNK_VALUES + 1
    noise = ThreadRecordingNoise(3)
    feed = NoiseFeed(noise, size)
    feed.request(0)
    feed.request(1)
    step_0 = feed.take(0).copy()
    step_1 = feed.take(1)
    assert set(noise.drawn_on) == {(GRADIENT_NOISE, 0), (GRADIENT_NOISE, 1)}
    assert all(name != threading.current_thread().name for name in noise.drawn_on.values())
    np.testing.assert_array_equal(step_0, GaussianNoise(SecretKey.from_seed(3)).draw(size, 1.0, (GRADIENT_NOISE, 0)))
    np.testing.assert_array_equal(step_1, GaussianNoise(SecretKey.from_seed(3)).draw(size, 1.0, (GRADIENT_NOISE, 1)))
    with pytest.raises(RuntimeError, match="already taken"):
        feed.take(1)
    # Requesting a step already handed out draws nothing.
    feed.request(0)
    step_2 = feed.take(2)
    assert len(noise.drawn_on) == 3
    # Double-buffered: step 2 reuses step 0's buffer, step 1's is left as it was.
    np.testing.assert_array_equal(step_1, GaussianNoise(SecretKey.from_seed(3)).draw(size, 1.0, (GRADIENT_NOISE, 1)))
    assert not np.shares_memory(step_2, step_1)
    feed.close()


def test_noise_the_silos_add_is_never_drawn_at_the_driver_and_each_step_is_still_taken_once():
    noise = ThreadRecordingNoise(3)
    central = CentralNoise(noise, CHUNK_VALUES + 1, 4, at_driver=False)
    try:
        central.request(0)
        assert central.take(0) is None
        with pytest.raises(RuntimeError, match="already taken"):
            central.take(0)
        parts = [np.arange(5.0), np.ones(5)]
        out = np.empty(5, dtype=np.float32)
        central.mean_gradient(parts, central.take(1), 0.0, 4.0, out)
        np.testing.assert_array_equal(out, (np.arange(5.0) + 1) / 4)
        assert noise.drawn_on == {}
    finally:
        central.close()


def test_secure_noise_is_not_a_single_draw():
    seeded_plain = GaussianNoise(SecretKey.from_seed(4), secure=False).draw(1000, 1.0, (GRADIENT_NOISE, 0))
    seeded_secure = GaussianNoise(SecretKey.from_seed(4), secure=True).draw(1000, 1.0, (GRADIENT_NOISE, 0))
    assert not np.allclose(seeded_plain, seeded_secure)


def test_secure_noise_is_the_default():
    assert build_config(dict(steps=1, noise_multiplier=1.0)).secure_noise is True


@pytest.mark.parametrize(
    "schedule, expected_lr_after_10",
    [
        (LearningRateSchedule("constant"), 0.5),
        (LearningRateSchedule("step", gamma=0.1, step_size=10), 0.05),
        (LearningRateSchedule("exponential", gamma=0.9), 0.5 * 0.9**10),
        (LearningRateSchedule("cosine"), 0.5 * (1 + math.cos(math.pi * 10 / 20)) / 2),
    ],
)
def test_learning_rate_schedules(schedule, expected_lr_after_10):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler = build_lr_scheduler(schedule, optimizer, total_steps=20)
    for _ in range(10):
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr_after_10)
