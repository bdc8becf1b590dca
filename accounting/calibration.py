"""Inverse accounting: the noise a target epsilon needs, the steps a budget allows."""

from __future__ import annotations

import math
from typing import Callable

from accounting.accountants import DEFAULT_ACCOUNTANT, AccountingError, get_accountant
from accounting.events import EventsLike, SampledGaussian

# Bisection stops when the bracket is this tight (relative), well inside the
# promised 0.1% of the smallest noise multiplier that meets the target.
_RELATIVE_TOLERANCE = 2e-4
_LARGEST_NOISE_MULTIPLIER = 1e4
_SMALLEST_NOISE_MULTIPLIER = 1e-2
_LARGEST_STEPS = 10**8


class UnreachableTargetError(AccountingError):
    """No parameter in the searched range meets the requested budget."""


def _check_target(target_epsilon: float) -> float:
    target_epsilon = float(target_epsilon)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0.0):
        raise AccountingError(f"target epsilon must be a finite number > 0 (got {target_epsilon!r})")
    return target_epsilon


def noise_multiplier_for(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: str = DEFAULT_ACCOUNTANT,
    sensitivity_factor: float = 1.0,
) -> float:
    """Smallest noise multiplier (to 0.1%) whose run is (target_epsilon, delta)-DP.

    The result meets the target, and a noise multiplier 0.1% smaller does not.
    """
    return scale_for_target(
        target_epsilon,
        delta,
        lambda noise_multiplier: SampledGaussian(sampling_rate, noise_multiplier, steps, sensitivity_factor),
        accountant,
    )


def scale_for_target(
    target_epsilon: float,
    delta: float,
    events_at: Callable[[float], EventsLike],
    accountant: str = DEFAULT_ACCOUNTANT,
) -> float:
    """Smallest scale s (to 0.1%) such that `events_at(s)` is (target_epsilon, delta)-DP.

    `events_at` maps a base noise multiplier to the run's events (a constant
    sigma, or a whole noise schedule scaled by it); epsilon must fall as s
    grows. Bracketed bisection in log space.
    """
    target_epsilon = _check_target(target_epsilon)
    interpreter = get_accountant(accountant)

    def epsilon_at(scale: float) -> float:
        return interpreter.epsilon(events_at(scale), delta)

    upper = 1.0
    while epsilon_at(upper) > target_epsilon:
        upper *= 2.0
        if upper > _LARGEST_NOISE_MULTIPLIER:
            raise UnreachableTargetError(
                f"target epsilon {target_epsilon:g} needs a noise multiplier above {_LARGEST_NOISE_MULTIPLIER:g}; "
                "raise the target, or lower the batch size or the number of steps"
            )
    lower = upper / 2.0
    while epsilon_at(lower) <= target_epsilon:
        upper, lower = lower, lower / 2.0
        if lower < _SMALLEST_NOISE_MULTIPLIER:
            return upper
    while upper / lower - 1.0 > _RELATIVE_TOLERANCE:
        middle = math.sqrt(upper * lower)
        if epsilon_at(middle) <= target_epsilon:
            upper = middle
        else:
            lower = middle
    return upper


def max_steps_for(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    noise_multiplier: float,
    accountant: str = DEFAULT_ACCOUNTANT,
    sensitivity_factor: float = 1.0,
) -> int:
    """The largest number of steps whose run is (target_epsilon, delta)-DP (0 if none)."""
    target_epsilon = _check_target(target_epsilon)
    interpreter = get_accountant(accountant)

    def fits(steps: int) -> bool:
        event = SampledGaussian(sampling_rate, noise_multiplier, steps, sensitivity_factor)
        return interpreter.epsilon(event, delta) <= target_epsilon

    if not fits(1):
        return 0
    lower, upper = 1, 2
    while fits(upper):
        lower, upper = upper, upper * 2
        if upper > _LARGEST_STEPS:
            return lower
    while upper - lower > 1:
        middle = (lower + upper) // 2
        if fits(middle):
            lower = middle
        else:
            upper = middle
    return lower
