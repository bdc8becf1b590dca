"""Adaptive clipping: the clip norm converges to the target quantile, and the events carry the pair's sigma."""

import numpy as np
import pytest

from orchestrator.adaptive_clipping import (
    AdaptiveClipping,
    effective_noise_multiplier,
    next_clip_norm,
    noisy_unclipped_fraction,
    noisy_unclipped_microbatch_fraction,
)
from orchestrator.config import build_config, parse_adaptive_clipping
from orchestrator.errors import UsageError
from orchestrator.sampling import assign_microbatches, make_generator, poisson_sample
from orchestrator.planning import plan_run


@pytest.mark.parametrize("update, learning_rate", [("geometric", 0.2), ("linear", 0.05)])
@pytest.mark.parametrize("target", [0.3, 0.5, 0.9])
def test_clip_norm_converges_to_the_target_quantile_of_synthetic_norms(update, learning_rate, target):
    generator = make_generator(17, 0)
    norms = generator.lognormal(mean=0.0, sigma=0.5, size=20_000)
    settings = AdaptiveClipping(target, learning_rate, update, count_noise_multiplier=5.0)
    rate, clip_norm, history = 0.02, 0.1, []
    for _ in range(1500):
        batch = norms[poisson_sample(generator, norms.size, rate)]
        unclipped = float((batch <= clip_norm).sum())
        fraction = noisy_unclipped_fraction(unclipped, batch.size, generator.normal(0, 5.0), rate * norms.size)
        clip_norm = next_clip_norm(clip_norm, fraction, settings)
        history.append(clip_norm)
    settled = np.median(history[-500:])
    # The population fraction under the settled clip norm is the target, within 0.05.
    assert (norms <= settled).mean() == pytest.approx(target, abs=0.05)


@pytest.mark.parametrize("target", [0.3, 0.9])
def test_with_microbatches_the_clip_norm_converges_to_the_target_quantile_of_microbatch_norms(target):
    # A microbatch's "norm" here is the mean of its members' synthetic norms; empty ones count as unclipped.
    generator = make_generator(23, 0)
    norms = generator.lognormal(mean=0.0, sigma=0.5, size=20_000)
    settings = AdaptiveClipping(target, 0.001, "linear", count_noise_multiplier=0.32)  # MindArmour's settings
    rate, groups, clip_norm, history, seen = 0.0128, 32, 0.5, [], []
    for _ in range(3000):
        batch = norms[poisson_sample(generator, norms.size, rate)]
        group_ids = assign_microbatches(generator, batch.size, groups)
        group_norms = np.array([batch[group_ids == g].mean() for g in np.unique(group_ids)])
        unclipped = float((group_norms <= clip_norm).sum()) + groups - group_norms.size
        fraction = noisy_unclipped_microbatch_fraction(unclipped, groups, generator.normal(0, 0.32))
        clip_norm = next_clip_norm(clip_norm, fraction, settings)
        history.append(clip_norm)
        seen.append(group_norms)
    settled = np.median(history[-1000:])
    assert (np.concatenate(seen[-1000:]) <= settled).mean() == pytest.approx(target, abs=0.05)


def test_the_microbatch_fraction_is_over_the_fixed_number_of_microbatches():
    assert noisy_unclipped_microbatch_fraction(24, 32, 0.0) == pytest.approx(0.75)
    assert noisy_unclipped_microbatch_fraction(24, 32, 3.2) == pytest.approx(0.85)


def test_the_noisy_fraction_is_centred_and_scaled_by_the_expected_batch():
    assert noisy_unclipped_fraction(30, 40, 0.0, 40.0) == pytest.approx(0.75)
    assert noisy_unclipped_fraction(30, 40, 4.0, 40.0) == pytest.approx(0.85)


def test_effective_noise_multiplier_of_the_pair():
    assert effective_noise_multiplier(1.0, 10.0) == pytest.approx((1 + 1 / 400) ** -0.5)
    assert effective_noise_multiplier(1.3, 1e9) == pytest.approx(1.3)
    assert effective_noise_multiplier(1.0, 0.5) == pytest.approx(2**-0.5)


def test_the_plan_accounts_the_gradient_and_count_pair():
    config = build_config(dict(steps=50, batch_size=60, train_subset=600, noise_multiplier=1.0,
                               adaptive_clipping={"count_noise_multiplier": 2.0}))
    (event,) = plan_run(config).planned_events.events
    assert event.noise_multiplier == pytest.approx(effective_noise_multiplier(1.0, 2.0))


@pytest.mark.parametrize(
    "value, message",
    [
        ({"target_quantile": 1.5}, "target_quantile must be in (0, 1)"),
        ({"update": "cosine"}, "adaptive_clipping.update must be one of geometric, linear"),
        ({"speed": 1}, "unknown: speed"),
        ({"count_noise_multiplier": 0}, "count_noise_multiplier must be > 0"),
    ],
)
def test_bad_adaptive_settings_are_usage_errors(value, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_adaptive_clipping(value)


def test_with_microbatches_the_plan_accounts_the_pair_with_sensitivity_factor_2():
    # Gradient sensitivity 2C with noise sigma*C, count sensitivity 1 with noise sigma_b:
    # ((sigma/2)^-2 + sigma_b^-2)^-1/2 per unit sensitivity, i.e. the per-example pair's sigma at factor 2.
    config = build_config(dict(steps=50, batch_size=60, train_subset=600, noise_multiplier=1.0, microbatch_size=6,
                               adaptive_clipping={"count_noise_multiplier": 2.0}))
    (event,) = plan_run(config).planned_events.events
    assert event.sensitivity_factor == 2.0
    assert event.effective_noise_multiplier == pytest.approx(((1.0 / 2) ** -2 + 2.0**-2) ** -0.5)
