"""Adaptive clipping: the clip norm converges to the target quantile, and the events carry the pair's sigma."""

import numpy as np
import pytest

from orchestrator.adaptive_clipping import (
    AdaptiveClipping,
    effective_noise_multiplier,
    next_clip_norm,
    noisy_unclipped_fraction,
    parse_adaptive_clipping,
)
from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.sampling import make_generator, poisson_sample
from orchestrator.trainer import plan_run


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


def test_adaptive_clipping_and_microbatches_do_not_mix():
    with pytest.raises(UsageError, match="cannot be combined with microbatch_size"):
        build_config(dict(steps=5, noise_multiplier=1.0, microbatch_size=4, adaptive_clipping=True))
