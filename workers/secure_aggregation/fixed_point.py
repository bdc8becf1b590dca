"""Fixed-point encoding of float vectors on the ring Z_{2^64}, and the bound that keeps a sum of them from wrapping.

A value x is sent as round(x * scale) mod 2^64 (two's complement); the ring
sum of the parties' encodings decodes to their float sum as long as the true
integer sum lies in [-2^63, 2^63). `fixed_point_scale` picks the largest
power-of-two scale for which that holds whatever the parties send within
their stated bound, and `check_no_wrap` refuses a scale for which it may not.
The encoding of each value is off by at most 1 / (2 * scale), so the decoded
sum of P parties is off by at most P / (2 * scale) in each coordinate.

With the noise added by the silos (`silo_noise_scale`, ``noise.noise_share``), the
scale is the smallest power of two at which rounding moves one example's
effect by a small fraction r (√d ≤ r·s·C), and the bound on the sum adds
the noise's tail (`noise_tail_bound`), which a coordinate passes with a
probability below 2^-40 a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

RING_BITS = 64
RING_DTYPE = np.uint64
# The sum's magnitude must stay below half the ring: the top bit is the sign.
HALF_RING = 2 ** (RING_BITS - 1)


def largest_sum(value_bound: float, parties: int, scale: float, noise_bound: float = 0.0) -> float:
    """The largest magnitude the integer sum of `parties` encodings can have when each |value| ≤ `value_bound`.

    `value_bound` bounds one coordinate of the parties' float total (for
    clipped sums: the clip norm C times the most examples all silos hold);
    each party's rounding adds at most 1/2, and the noise at most
    `noise_bound` (ring units; `noise_tail_bound`).
    """
    return value_bound * scale + parties * 0.5 + noise_bound


def noise_tail_bound(variance: float, coordinates: int, failure: float = 2.0 ** -40) -> float:
    """A bound that every one of `coordinates` coordinates of a sum of discrete Gaussian shares of summed
    per-coordinate `variance` stays within, but with probability below `failure`.

    N_Z(0, σ²) is σ-subgaussian (Canonne, Kamath and Steinke 2020 prove
    E e^(θX) ≤ e^(θ²σ²/2)), and so is a sum of independent shares with their summed
    variance: P(|X| ≥ x) ≤ 2 exp(−x² / (2v)), so x = √(2v·ln(2·coordinates /
    failure)) makes the union over the coordinates smaller than `failure`.
    """
    if variance == 0:
        return 0.0
    return math.sqrt(2 * variance * math.log(2 * coordinates / failure))


def silo_noise_scale(clip_bound: float, coordinates: int, rounding_ratio: float) -> float:
    """The smallest power of two s with √`coordinates` ≤ `rounding_ratio`·s·`clip_bound`.

    Rounding each coordinate of s times a clipped sum then moves one
    example's effect (at most s·C in L2) by at most r·s·C more.
    """
    if not (clip_bound > 0 and coordinates >= 1 and 0 < rounding_ratio <= 1):
        raise ValueError(f"the silo noise's scale needs a clip bound > 0, coordinates >= 1 and a rounding ratio in "
                         f"(0, 1] (got {clip_bound}, {coordinates}, {rounding_ratio})")
    return 2.0 ** math.ceil(math.log2(math.sqrt(coordinates) / (rounding_ratio * clip_bound)))


def check_no_wrap(scale: float, value_bound: float, parties: int, noise_bound: float = 0.0) -> None:
    """Raise ValueError when the sum of `parties` encodings at `scale` of values within `value_bound`, plus noise
    within `noise_bound` (ring units), may wrap."""
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"the fixed-point scale must be a finite number > 0 (got {scale})")
    if parties < 1:
        raise ValueError(f"the number of parties must be ≥ 1 (got {parties})")
    if not value_bound >= 0:
        raise ValueError(f"the bound on a coordinate of the total must be ≥ 0 (got {value_bound})")
    largest = largest_sum(value_bound, parties, scale, noise_bound)
    if largest >= HALF_RING:
        raise ValueError(
            f"a total of up to {value_bound:g} per coordinate at fixed-point scale {scale:g} over {parties} parties "
            f"(noise up to {noise_bound:.3g} included) reaches {largest:.3g}, which wraps the ring Z_2^{RING_BITS} (its sums must stay below 2^{RING_BITS - 1}"
            f" = {HALF_RING:.3g}); lower the scale, the clip norm or the examples per silo"
        )


def fixed_point_scale(value_bound: float, parties: int) -> float:
    """The largest power of two 2^k (k ≤ 52) at which `parties` encodings of values within `value_bound` cannot wrap.

    A factor of 2 is kept as headroom below half the ring, and k stops at 52
    because a float64 holds no finer fraction of a value near 1.
    """
    if not value_bound > 0:
        raise ValueError(f"the bound on a coordinate of the total must be > 0 (got {value_bound})")
    exponent = min(52, math.floor(math.log2((HALF_RING / 2 - parties) / value_bound)))
    scale = 2.0 ** exponent
    check_no_wrap(scale, value_bound, parties)
    return scale


def encode(values: np.ndarray, scale: float, value_bound: float) -> np.ndarray:
    """`values` as round(values * scale) mod 2^64 (uint64); a value beyond ±`value_bound` or not finite is refused.

    The check keeps one party from wrapping the sum on its own (a clipped sum
    can never exceed its bound; a non-finite one is a bug upstream).
    """
    values = np.asarray(values)
    # NaN makes the peak NaN, which fails the comparison as infinity does.
    if values.size and not np.max(np.abs(values)) <= value_bound:
        raise ValueError(f"a value to encode lies outside ±{value_bound:g} or is not finite: the bound checked at "
                         "start no longer holds, so the ring sum could wrap")
    scaled = values.astype(np.float64)
    scaled *= scale
    np.rint(scaled, out=scaled)
    return scaled.astype(np.int64).view(RING_DTYPE)


def decode(ring_values: np.ndarray, scale: float) -> np.ndarray:
    """The float64 values a ring vector (uint64, two's complement) encodes at `scale`."""
    return np.asarray(ring_values, dtype=RING_DTYPE).view(np.int64).astype(np.float64) / scale


def ring_sum(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The sum of uint64 ring vectors modulo 2^64 (numpy's unsigned addition wraps as the ring does)."""
    if not parts:
        raise ValueError("a ring sum needs at least one part")
    total = np.array(parts[0], dtype=RING_DTYPE, copy=True)
    for part in parts[1:]:
        total += part
    return total
