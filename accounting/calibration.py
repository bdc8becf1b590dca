"""Inverse accounting: the noise a target epsilon needs, the steps a budget allows."""

from __future__ import annotations

import math
from typing import Callable

from accounting.accountants import DEFAULT_ACCOUNTANT, Accountant, AccountingError, PldAccountant, get_accountant
from accounting.events import EventsLike, SampledGaussian

# The search stops when the bracket is this tight (relative), inside the promised
# 0.1% of the smallest noise multiplier that meets the target: 0.999 times the
# answer lies below the bracket's lower end, which misses the target.
_RELATIVE_TOLERANCE = 5e-4
_LARGEST_NOISE_MULTIPLIER = 1e4
_SMALLEST_NOISE_MULTIPLIER = 1e-2
_LARGEST_STEPS = 10**8
# Per accountant, the accountants a calibration asks in turn, each with its first bracketing step from the answer
# before it. The central-limit GDP epsilon is a closed form whose answer is within about 15% of the rigorous
# ones. PLD on a grid 3 times coarser costs a third and its answer lies a few 0.01% above PLD's own, so PLD's
# first step is just inside the tolerance: when that step brackets the answer, two evaluations close the search.
_GDP = get_accountant("gdp")
_PLD = get_accountant("pld")
_SEARCH_STAGES: dict[str, tuple[tuple[Accountant, float], ...]] = {
    "gdp": ((_GDP, 2.0),),
    "rdp": ((_GDP, 2.0), (get_accountant("rdp"), 1.04)),
    "pld": ((_GDP, 2.0), (PldAccountant(value_interval=3 * _PLD.value_interval), 1.04),
            (_PLD, 1.0 + 0.95 * _RELATIVE_TOLERANCE)),
}


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
    grows. The search goes through `_SEARCH_STAGES`: cheaper accountants
    first, each starting from the answer before it, so that the accountant
    asked for is evaluated a few times in a tight bracket. Only its own
    epsilon decides the answer: the guesses set where the search starts.
    """
    get_accountant(accountant)  # an unknown name fails here, before any search
    *guides, (interpreter, first_step) = _SEARCH_STAGES[accountant]
    scale = 1.0
    for guide, guide_step in guides:
        try:
            scale = scale_for_epsilon(target_epsilon, lambda s, guide=guide: guide.epsilon(events_at(s), delta),
                                      start=scale, step=guide_step)
        except UnreachableTargetError:
            # Only the accountant asked for may say that no noise multiplier meets the target.
            scale = _LARGEST_NOISE_MULTIPLIER
    return scale_for_epsilon(target_epsilon, lambda s: interpreter.epsilon(events_at(s), delta),
                             start=scale, step=first_step)


def scale_for_epsilon(
    target_epsilon: float, epsilon_at: Callable[[float], float], start: float = 1.0, step: float = 2.0
) -> float:
    """Smallest scale s (to 0.1%) with `epsilon_at(s)` <= `target_epsilon`; epsilon must fall as s grows.

    `epsilon_at` is any epsilon of the run at base noise multiplier s: an
    accountant's (`scale_for_target`), or the RDP-filter epsilon a ledger
    budget charges for it. The answer is bracketed by walking from `start`
    by the factor `step`, squared at each move, then the bracket is closed
    by `_close_bracket`.
    """
    target_epsilon = _check_target(target_epsilon)

    def excess(scale: float) -> float:
        """log(epsilon / target): positive where `scale` is too small, never NaN."""
        epsilon = epsilon_at(scale)
        return math.log(epsilon / target_epsilon) if epsilon > 0.0 else -math.inf

    scale, scale_excess = start, excess(start)
    if scale_excess > 0.0:
        while scale_excess > 0.0:
            if scale >= _LARGEST_NOISE_MULTIPLIER:
                raise UnreachableTargetError(
                    f"target epsilon {target_epsilon:g} needs a noise multiplier above "
                    f"{_LARGEST_NOISE_MULTIPLIER:g}; raise the target, or lower the batch size or the number of steps"
                )
            lower = scale, scale_excess
            scale, step = min(scale * step, _LARGEST_NOISE_MULTIPLIER), step * step
            scale_excess = excess(scale)
        return _close_bracket(excess, lower, (scale, scale_excess))
    while scale_excess <= 0.0:
        if scale <= _SMALLEST_NOISE_MULTIPLIER:
            return scale
        upper = scale, scale_excess
        scale, step = max(scale / step, _SMALLEST_NOISE_MULTIPLIER), step * step
        scale_excess = excess(scale)
    return _close_bracket(excess, (scale, scale_excess), upper)


def _close_bracket(excess: Callable[[float], float], lower: tuple[float, float], upper: tuple[float, float]) -> float:
    """The upper end of [lower, upper] once it is within _RELATIVE_TOLERANCE, keeping excess(lower) > 0 >= excess(upper).

    Each probe is the root of the secant through the two ends in (log scale,
    log epsilon), where epsilon is nearly straight; when one end has stayed
    put twice running, its excess is halved (the Illinois rule), so both ends
    close in. A probe keeps a quarter of the tolerance from either end, and
    an infinite end falls back to bisection: a handful of accountant calls
    instead of bisection's dozen or more.
    """
    (low, low_excess), (high, high_excess) = lower, upper
    margin = math.log1p(_RELATIVE_TOLERANCE / 4.0)
    kept = 0  # +1: the upper end moved last; -1: the lower end moved last
    while high / low - 1.0 > _RELATIVE_TOLERANCE:
        log_low, log_high = math.log(low), math.log(high)
        if math.isfinite(low_excess) and math.isfinite(high_excess):
            probe = log_high - high_excess * (log_high - log_low) / (high_excess - low_excess)
        else:
            probe = (log_low + log_high) / 2.0
        scale = math.exp(min(max(probe, log_low + margin), log_high - margin))
        scale_excess = excess(scale)
        if scale_excess <= 0.0:
            high, high_excess = scale, scale_excess
            if kept == 1:
                low_excess /= 2.0
            kept = 1
        else:
            low, low_excess = scale, scale_excess
            if kept == -1:
                high_excess /= 2.0
            kept = -1
    return high


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
