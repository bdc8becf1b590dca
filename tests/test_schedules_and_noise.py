"""Noise schedules are accounted exactly; secure noise has the right distribution; LR schedules post-process."""

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp
from scipy import stats

from accounting.accountants import RDP_ORDERS, get_accountant
from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.noise import GaussianNoise
from orchestrator.schedules import (
    LearningRateSchedule,
    NoiseSchedule,
    build_lr_scheduler,
    noise_blocks,
    parse_noise_schedule,
    schedule_events,
)
from orchestrator.trainer import plan_run

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


def test_secure_noise_is_gaussian_with_the_right_scale():
    values = GaussianNoise(seed=21, secure=True).draw(200_000, 1.95)
    assert values.std() == pytest.approx(1.95, rel=0.01)
    result = stats.kstest(values / 1.95, "norm")
    assert result.pvalue > 1e-3
    assert stats.kurtosis(values) == pytest.approx(0.0, abs=0.05)


def test_secure_noise_is_not_a_single_draw():
    seeded_plain = GaussianNoise(seed=4, secure=False).draw(1000, 1.0)
    seeded_secure = GaussianNoise(seed=4, secure=True).draw(1000, 1.0)
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
