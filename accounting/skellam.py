"""The Skellam mechanism's Rényi DP, alone and Poisson-subsampled: the accountant of the noise that silos add.

Each silo adds to its rounded sum a share of exact discrete Gaussian noise
N_Z(0, v) with v ≥ (σ·s·C)² (``workers.secure_aggregation.noise``), so that
one honest silo's share carries the target alone. Canonne, Kamath and
Steinke (NeurIPS 2020, arXiv 2004.00010) show that N_Z(0, μ) on an integer
query of L2 sensitivity Δ2 has Rényi divergence at most α Δ2² / (2μ), the
continuous Gaussian's; the other silos' shares are independent noise added
on top, which only post-processes it. That is the leading term of the bound
that Agarwal, Kairouz and Liu ("The Skellam Mechanism for Differentially
Private Federated Learning", NeurIPS 2021, arXiv 2110.04995, Theorem 3.5,
with μ the per-coordinate variance) prove for Skellam noise, at integer
orders α > 1, for an integer query of L2 sensitivity Δ2 and L1 sensitivity Δ1:

    ε(α) ≤ α Δ2² / (2μ) + min(((2α − 1) Δ2² + 6 Δ1) / (4μ²), 3 Δ1 / (2μ))

so this bound, whose second term is ≥ 0, bounds the silos' noise too, a
little above its own RDP; the ledger's records of such steps keep their kind
(``sampled_skellam``) and this accountant (`skellam_rdp`).

Poisson subsampling at rate q is bounded by the general
upper bound of Zhu and Wang ("Poisson Subsampled Rényi Differential
Privacy", ICML 2019, Theorem 6), which needs only the base mechanism's RDP
at the integer orders 2..α (`poisson_subsampled_rdp`). Rényi divergence does
not decrease with the order, so a fractional order is bounded by the integer
order above it, and orders below 2 by order 2.

A training step in these units (`sampled_skellam_rdp`): each silo scales
its clipped sum by s, rounds it to integers and adds its share. One example
moves the scaled sum by at most k·s·C in L2 (k the sensitivity factor), and
rounding each coordinate moves it by at most 1/2, so rounded sums of
neighbouring datasets differ by Δ2 ≤ k·s·C + √d in L2 (d coordinates) and
Δ1 ≤ √d·Δ2 in L1. The run picks s so that √d ≤ r·s·C for its rounding
ratio r; in units of s·C then Δ2 ≤ k + r, Δ1 ≤ r·(k + r)·s·C and μ = σ²(s·C)²,
where σ is the noise multiplier one honest silo's share guarantees. The terms
with μ² only shrink as s·C grows, and s·C ≥ √d / r ≥ 1, so evaluating them at
s·C = 1 bounds them: the step's RDP depends on (q, σ, k, r) alone, not on d.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from accounting.lazy import LazyModule

special = LazyModule("scipy.special")

# The rounding ratio r a run's silos keep √d / (s·C) below: the rounded sum's sensitivity is (k + r)·s·C, so rounding
# costs a factor (1 + r)² ≈ 1.0005 in the leading term of the RDP, and s stays small enough for int64 shares.
SILO_NOISE_ROUNDING_RATIO = 2.0 ** -12


def skellam_rdp(order: float | np.ndarray, l2_sensitivity: float, l1_sensitivity: float,
                variance: float) -> float | np.ndarray:
    """The Skellam mechanism's Rényi divergence at integer `order` > 1 (Agarwal et al. 2021, Theorem 3.5).

    `variance` is the noise's per-coordinate variance μ; the sensitivities are
    those of the integer query it is added to, in the same units.
    """
    if not (l2_sensitivity >= 0 and l1_sensitivity >= 0 and variance > 0):
        raise ValueError(f"the Skellam RDP needs sensitivities >= 0 and a variance > 0 (got L2 {l2_sensitivity}, "
                         f"L1 {l1_sensitivity}, variance {variance})")
    squared = l2_sensitivity ** 2
    discrete = np.minimum(((2 * order - 1) * squared + 6 * l1_sensitivity) / (4 * variance ** 2),
                          3 * l1_sensitivity / (2 * variance))
    return order * squared / (2 * variance) + discrete


def poisson_subsampled_rdp(order: int, sampling_rate: float, rdp_at: Callable[[np.ndarray], np.ndarray]) -> float:
    """Zhu and Wang's (2019, Theorem 6) bound on the RDP at integer `order` ≥ 2 of a mechanism run on a Poisson
    sample at `sampling_rate`, from the mechanism's own RDP `rdp_at(orders)` at the integer orders 2..`order`;
    never above the mechanism's own RDP at `order`.

    (α−1)·ε'(α) ≤ log[(1−q)^(α−1)(αq − q + 1) + C(α,2) q² (1−q)^(α−2) e^ε(2)
                     + 3 Σ_{ℓ=3..α} C(α,ℓ) q^ℓ (1−q)^(α−ℓ) e^((ℓ−1)ε(ℓ))]
    """
    if isinstance(order, bool) or int(order) != order or order < 2:
        raise ValueError(f"the subsampled bound is for integer orders >= 2 (got {order!r})")
    if not 0.0 < sampling_rate <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1] (got {sampling_rate!r})")
    order = int(order)
    own = float(rdp_at(np.array([order], dtype=np.float64))[0])
    if sampling_rate == 1.0:
        return own
    ells = np.arange(2, order + 1, dtype=np.float64)
    rdp = np.asarray(rdp_at(ells), dtype=np.float64)
    log_q, log_rest = math.log(sampling_rate), math.log1p(-sampling_rate)
    log_binomial = special.gammaln(order + 1) - special.gammaln(ells + 1) - special.gammaln(order - ells + 1)
    terms = log_binomial + ells * log_q + (order - ells) * log_rest + (ells - 1) * rdp
    terms[1:] += math.log(3.0)  # the terms ℓ ≥ 3 carry Theorem 6's factor 3; ℓ = 2 has none
    first = (order - 1) * log_rest + math.log1p((order - 1) * sampling_rate)
    total = float(special.logsumexp(np.concatenate(([first], terms))))
    return min(own, total / (order - 1))


def sampled_skellam_rdp(orders: Sequence[float], sampling_rate: float, noise_multiplier: float,
                        sensitivity_factor: float, rounding_ratio: float) -> np.ndarray:
    """One step's RDP at `orders`: Skellam noise of std `noise_multiplier`·s·C on an integer sum rounded from s
    times a Poisson(`sampling_rate`) sample's clipped sum, with √d ≤ `rounding_ratio`·s·C (module docstring).

    Each order α is bounded at the integer max(2, ⌈α⌉).
    """
    if not (noise_multiplier > 0 and sensitivity_factor > 0 and 0 <= rounding_ratio <= 1):
        raise ValueError(f"a sampled Skellam step needs noise_multiplier > 0, sensitivity_factor > 0 and "
                         f"rounding_ratio in [0, 1] (got {noise_multiplier}, {sensitivity_factor}, {rounding_ratio})")
    l2 = sensitivity_factor + rounding_ratio
    l1 = rounding_ratio * l2

    def rdp_at(integer_orders: np.ndarray) -> np.ndarray:
        return skellam_rdp(integer_orders, l2, l1, noise_multiplier ** 2)

    integers = sorted({max(2, math.ceil(order)) for order in orders})
    at_integer = {order: poisson_subsampled_rdp(order, sampling_rate, rdp_at) for order in integers}
    return np.array([at_integer[max(2, math.ceil(order))] for order in orders], dtype=np.float64)
