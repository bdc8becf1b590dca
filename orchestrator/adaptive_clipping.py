"""Adaptive clipping (Andrew et al. 2021): the clip norm follows a target quantile of per-example norms.

Each step the workers also report how many of their examples had a gradient
norm at or below the current clip norm. The driver centres that raw count
(count - n/2, whose sensitivity to one example is 1/2), adds N(0, sigma_b^2)
noise, and only that noisy fraction moves the clip norm. The gradient query
(sensitivity C, noise sigma*C) and the count query (sensitivity 1/2, noise
sigma_b) together are exactly a Gaussian mechanism with noise multiplier
(sigma^-2 + (2 sigma_b)^-2)^(-1/2), which is what the events carry.

With microbatches the count is over the G microbatches of the step instead:
how many had a clipped-gradient norm at or below C, an empty one counting as
unclipped (its gradient is zero). G is fixed, and adding or removing one
example changes one microbatch, so the count moves by at most 1 while the
gradient sum moves by at most 2C: both sensitivities double, the pair is
accounted with sensitivity factor 2 and the same effective noise multiplier,
and the noisy fraction is (count + noise) / G.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from orchestrator.table import table

UPDATES = ("geometric", "linear")


@table
class AdaptiveClipping:
    """Target quantile gamma, clip learning rate eta, update rule, and the count's noise sigma_b."""

    target_quantile: float = Field(
        0.5, gt=0, lt=1, description="γ: the fraction of per-example gradient norms the clip norm aims to sit above.")
    learning_rate: float = Field(0.2, gt=0, description="η: how far one step moves the clip norm.")
    update: Literal[UPDATES] = Field(
        "geometric", description="How the clip norm moves: geometric C·exp(-η(b - γ)), or linear C - η(b - γ).")
    count_noise_multiplier: float = Field(
        10.0, gt=0, description="σ_b: the standard deviation of the noise on the centred unclipped count.")


def effective_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float) -> float:
    """The noise multiplier of the (gradient, centred count) pair: (sigma^-2 + (2 sigma_b)^-2)^(-1/2)."""
    return (noise_multiplier**-2 + (2.0 * count_noise_multiplier) ** -2) ** -0.5


def noisy_unclipped_fraction(
    unclipped: float, realised_batch: int, count_noise: float, expected_batch_size: float
) -> float:
    """The released estimate of the unclipped fraction: ((unclipped - n/2) + noise) / (q N) + 1/2.

    `unclipped` and `realised_batch` are raw counts; only this noisy result leaves the driver.
    """
    return (unclipped - realised_batch / 2.0 + count_noise) / expected_batch_size + 0.5


def noisy_unclipped_microbatch_fraction(unclipped_microbatches: float, microbatches: int, count_noise: float) -> float:
    """The released estimate of the unclipped fraction of the G microbatches: (count + noise) / G.

    `unclipped_microbatches` is the raw count, empty microbatches included; only this noisy result leaves the driver.
    """
    return (unclipped_microbatches + count_noise) / microbatches


def next_clip_norm(clip_norm: float, unclipped_fraction: float, settings: AdaptiveClipping) -> float:
    """One step towards the target quantile: geometric C*exp(-eta*(b - gamma)), or linear C - eta*(b - gamma)."""
    error = unclipped_fraction - settings.target_quantile
    if settings.update == "geometric":
        return clip_norm * math.exp(-settings.learning_rate * error)
    # A linear step could cross zero; a clip norm must stay positive.
    return max(clip_norm - settings.learning_rate * error, 1e-6)


def adapted_clip_norm(clip_norm: float, settings: AdaptiveClipping, count_noise: float, unclipped: float,
                      realised_batch: int, expected_batch_size: float, microbatches: int | None,
                      empty_microbatches: int) -> float:
    """The next step's clip norm, moved by the noisy unclipped fraction (the raw counts stay in the driver).

    `count_noise` is the step's N(0, count_noise_multiplier^2) draw.
    `unclipped` counts examples, or with `microbatches` the non-empty
    microbatches, to which the `empty_microbatches` are added as unclipped.
    """
    if not microbatches:
        fraction = noisy_unclipped_fraction(unclipped, realised_batch, count_noise, expected_batch_size)
    else:
        fraction = noisy_unclipped_microbatch_fraction(unclipped + empty_microbatches, microbatches, count_noise)
    return next_clip_norm(clip_norm, fraction, settings)
