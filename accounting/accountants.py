"""Accountants: interpret event records as (epsilon, delta).

Three interpreters of the same records:

- ``pld``: privacy-loss distributions (dp-accounting, pessimistic
  discretisation). A rigorous upper bound and the tightest of the three; the
  default.
- ``rdp``: Renyi DP over a wide order grid, converted to (epsilon, delta).
  Rigorous, looser than PLD.
- ``gdp``: the central-limit approximation of Bu et al. (Gaussian DP for
  Poisson-sampled SGD). Approximate: it can fall below the true epsilon, so it
  is never used for budgets and is always labelled approximate.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Protocol, Sequence

import numpy as np

from accounting.events import Composition, EventsLike, SampledSkellam, as_composition
from accounting.lazy import LazyModule
from accounting.skellam import sampled_skellam_rdp

# dp-accounting and scipy load when an epsilon is first computed: a ledger client, which shows the figures its
# server computed, and the command line's help never load them (dp-accounting's import is half of torch's).
rdp = LazyModule("dp_accounting.rdp")
privacy_loss_distribution = LazyModule("dp_accounting.pld.privacy_loss_distribution")
privacy_loss_mechanism = LazyModule("dp_accounting.pld.privacy_loss_mechanism")
pld_pmf = LazyModule("dp_accounting.pld.pld_pmf")
optimize = LazyModule("scipy.optimize")
special = LazyModule("scipy.special")

DEFAULT_ACCOUNTANT = "pld"

# dp-accounting's default grid (rdp_privacy_accountant.DEFAULT_RDP_ORDERS, written out so that the grid needs no
# import of it; a test keeps it in), widened at both ends: orders just above 1 matter for very large epsilon, orders
# in the thousands for tiny ones.
RDP_ORDERS = np.array(
    sorted(
        set([1.01, 1.02, 1.03, 1.05, 1.07])
        | set([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024])
        | set(range(64, 128, 8))
        | {1536, 2048, 4096, 8192}
    ),
    dtype=np.float64,
)


class AccountingError(ValueError):
    """A query to an accountant is outside its valid range."""


class PldFallbackWarning(UserWarning):
    """PLD was impractical (the privacy loss is enormous); the rigorous RDP bound is reported instead."""


class RdpOrderWarning(UserWarning):
    """The best RDP order lies at the edge of the grid, so epsilon may be loose."""


class Accountant(Protocol):
    """What every accountant offers: epsilon at a delta, and delta at an epsilon."""

    name: str
    rigorous: bool

    def epsilon(self, events: EventsLike, delta: float) -> float:
        """Smallest epsilon such that the events are (epsilon, delta)-DP."""

    def delta(self, events: EventsLike, epsilon: float) -> float:
        """Smallest delta such that the events are (epsilon, delta)-DP."""


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not (math.isfinite(delta) and 0.0 < delta < 1.0):
        raise AccountingError(f"delta must be in (0, 1) (got {delta!r})")
    return delta


def _check_epsilon(epsilon: float) -> float:
    epsilon = float(epsilon)
    if not (math.isfinite(epsilon) and epsilon >= 0.0):
        raise AccountingError(f"epsilon must be a finite number >= 0 (got {epsilon!r})")
    return epsilon


_PLD_VALUE_INTERVAL = 1e-4


# A one-step distribution is about 0.5 MB and 5-30 ms to build (`one_step_pld`). A ledger composes each dataset's
# distribution incrementally (accounting.ledger.composed), so it needs a mechanism's only while the jobs that use it
# commit: this many distinct mechanisms in flight at once (about 150 MB at most); one evicted is rebuilt in
# milliseconds, so thousands of mechanisms need no more room than this.
ONE_STEP_PLD_CACHE_SIZE = 256


def _gaussian_hockey_sticks(
    loss: privacy_loss_mechanism.GaussianPrivacyLoss, epsilons: np.ndarray
) -> np.ndarray:
    """`loss.get_delta_for_epsilon(epsilons)` for a Poisson-subsampled Gaussian of sensitivity 1, with the inverse
    privacy loss taken over the whole array at once.

    The same formulas as dp-accounting's (privacy_loss_mechanism,
    AdditiveNoisePrivacyLoss.get_delta_for_epsilon with GaussianPrivacyLoss's
    inverse), which takes the inverse one epsilon at a time in Python: 60,000
    calls, most of a one-step distribution's cost. A test holds the two equal.
    """
    q, variance = loss.sampling_prob, loss._standard_deviation**2
    remove = loss.adjacency_type == privacy_loss_mechanism.AdjacencyType.REMOVE
    deltas = np.zeros_like(epsilons)
    if q == 1.0:
        inverted = np.ones_like(epsilons, dtype=bool)
        without_sampling = epsilons
    else:
        # The loss before sampling: log(1 + (e^eps - 1) / q) (remove), -log(1 + (e^-eps - 1) / q) (add).
        edge = math.log1p(-q) if remove else -math.log1p(-q)
        inverted = epsilons > edge if remove else epsilons < edge
        if remove:
            deltas[~inverted] = -np.expm1(epsilons[~inverted])
        signed = epsilons[inverted] if remove else -epsilons[inverted]
        with np.errstate(divide="ignore"):
            log_q_scaled = signed + np.log(1 / q)
            unsampled = log_q_scaled + np.log1p(-np.exp(np.log(-(1 - 1 / q)) - log_q_scaled))
        unsampled[signed == 0] = np.log(1 / q + (1 - 1 / q))  # dp-accounting's own rounding of this one point
        # dp-accounting's edge case: at the edge (math.isclose) the inverse is at infinity.
        at_edge = np.abs(epsilons[inverted] - (math.log(1 - q) if remove else -math.log(1 - q))) <= 1e-9 * np.maximum(
            np.abs(epsilons[inverted]), abs(math.log(1 - q))
        )
        unsampled = np.where(at_edge, -np.inf if remove else np.inf, unsampled if remove else -unsampled)
        without_sampling = unsampled
    cutoffs = -0.5 - without_sampling * variance
    if not remove:
        cutoffs = cutoffs + 1.0
    chosen = epsilons[inverted]
    deltas[inverted] = loss.mu_upper_cdf(cutoffs) - np.exp(chosen + loss.mu_lower_log_cdf(cutoffs))
    return np.clip(deltas, 0, 1)


def _gaussian_pld_pmf(
    sampling_rate: float, noise_multiplier: float, value_interval: float, adjacency: str
) -> "pld_pmf.PLDPmf":
    """dp-accounting's pessimistic connect-the-dots PMF of one Poisson-subsampled Gaussian step (sensitivity 1) for
    `adjacency` (ADD or REMOVE), as `from_gaussian_mechanism` builds it, with its deltas vectorised."""
    loss = privacy_loss_mechanism.GaussianPrivacyLoss(
        noise_multiplier, sampling_prob=sampling_rate,
        adjacency_type=getattr(privacy_loss_mechanism.AdjacencyType, adjacency),
    )
    bounds = loss.connect_dots_bounds()
    upper = math.ceil(bounds.epsilon_upper / value_interval)
    lower = math.floor(bounds.epsilon_lower / value_interval)
    deltas = _gaussian_hockey_sticks(loss, np.arange(lower, upper + 1) * value_interval)
    return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(value_interval, lower, upper, deltas)


@functools.lru_cache(maxsize=ONE_STEP_PLD_CACHE_SIZE)
def one_step_pld(
    sampling_rate: float, noise_multiplier: float, value_interval: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """What privacy_loss_distribution.from_gaussian_mechanism(noise_multiplier, value_discretization_interval=
    value_interval, sampling_prob=sampling_rate) returns (pessimistic, connect the dots), in milliseconds."""
    remove = _gaussian_pld_pmf(sampling_rate, noise_multiplier, value_interval, "REMOVE")
    if sampling_rate == 1.0:
        return privacy_loss_distribution.PrivacyLossDistribution(remove)
    return privacy_loss_distribution.PrivacyLossDistribution(
        remove, _gaussian_pld_pmf(sampling_rate, noise_multiplier, value_interval, "ADD")
    )


def forget_plds() -> None:
    """Forget every cached one-step and composed PLD, as a new process starts without them."""
    one_step_pld.cache_clear()
    _pld_of.cache_clear()


@functools.lru_cache(maxsize=16)
def _pld_of(composition: Composition, value_interval: float) -> privacy_loss_distribution.PrivacyLossDistribution:
    return composed_pld(composition, value_interval)


def composed_pld(
    events: EventsLike,
    value_interval: float | None = None,
    onto: privacy_loss_distribution.PrivacyLossDistribution | None = None,
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """The pessimistic PLD of `events` on a grid of `value_interval` (default the reported one), composed onto
    `onto` (a PLD of other events on the same grid) when given.

    What dp-accounting's PLDAccountant composes for these events, from
    cached one-step distributions; a record of one step is composed as it is
    (dp-accounting self-composes it once, a convolution that adds only its
    rounding and 1e-15 of truncated tail, and half the cost of a ledger's
    commit of a new mechanism). Pessimistic distributions compose
    pessimistically (truncated tails go to the infinite loss), so a
    distribution built by composing onto an earlier one is an upper bound
    too, and equals the one built at once up to that truncation.
    """
    value_interval = _PLD_VALUE_INTERVAL if value_interval is None else value_interval
    total = onto if onto is not None else privacy_loss_distribution.identity(
        value_discretization_interval=value_interval
    )
    for event in as_composition(events).events:
        if isinstance(event, SampledSkellam):
            raise AccountingError("Skellam noise added by silos has no PLD here: account it by RDP "
                                  "(rdp_fallback_epsilon reports it)")
        step = one_step_pld(event.sampling_rate, event.effective_noise_multiplier, value_interval)
        total = total.compose(_self_composed(step, event.steps) if event.steps > 1 else step)
    return total


# dp-accounting's sparse PMF self-composes by first computing size ** times as one integer (for a support of one
# point, by composing it `times` times in Python): unbounded work that holds the GIL. Past this many steps it goes
# dense anyway (2 ** 10 points exceed its sparse limit of 1000), so a dense PMF gives the same distribution.
_SPARSE_SELF_COMPOSE_STEPS = 9


def _self_composed(
    step: privacy_loss_distribution.PrivacyLossDistribution, steps: int
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """`step` composed with itself `steps` times, through dense PMFs past a few steps (see above)."""
    if steps <= _SPARSE_SELF_COMPOSE_STEPS:
        return step.self_compose(steps)
    dense = privacy_loss_distribution.PrivacyLossDistribution(
        step._pmf_remove.to_dense_pmf(), None if step._symmetric else step._pmf_add.to_dense_pmf()
    )
    return dense.self_compose(steps)


# Below this effective noise multiplier, PLD's grid can grow without bound: check RDP first.
_PLD_SMALLEST_CHECKED_SIGMA = 0.3
# Above this epsilon there is no privacy left to measure finely; RDP's rigorous bound is reported.
_PLD_LARGEST_EPSILON = 100.0


def has_skellam(events: EventsLike) -> bool:
    """True when some record of `events` is Skellam noise added by silos, which only RDP accounts."""
    return any(isinstance(event, SampledSkellam) for event in as_composition(events).events)


def rdp_fallback_epsilon(events: EventsLike, delta: float) -> float | None:
    """The rigorous RDP ε at `delta` to report instead of PLD: for events with Skellam noise (no PLD here), and,
    with a PldFallbackWarning, where PLD's grid is impractical (ε beyond 100 with a noise multiplier below 0.3);
    None where PLD is practical."""
    composition = as_composition(events)
    if has_skellam(composition):
        return epsilon_from_rdp(rdp_vector(composition), delta, warn=False)
    if not composition.events or (
        min(event.effective_noise_multiplier for event in composition.events) >= _PLD_SMALLEST_CHECKED_SIGMA
    ):
        return None
    rdp_epsilon = epsilon_from_rdp(rdp_vector(composition), delta, warn=False)
    if rdp_epsilon <= _PLD_LARGEST_EPSILON:
        return None
    warnings.warn(
        f"epsilon exceeds {_PLD_LARGEST_EPSILON:g}, where PLD's grid becomes impractical; "
        f"reporting the rigorous RDP bound {rdp_epsilon:.4g} instead",
        PldFallbackWarning,
        stacklevel=3,
    )
    return rdp_epsilon


class PldAccountant:
    """Privacy-loss-distribution accounting with pessimistic discretisation (rigorous).

    `value_interval` is the grid of privacy-loss values: a coarser one is
    faster and its epsilon a looser upper bound (the noise calibration
    searches with one before it asks the reported grid).
    """

    name = "pld"
    rigorous = True

    def __init__(self, value_interval: float = _PLD_VALUE_INTERVAL) -> None:
        self.value_interval = value_interval

    def epsilon(self, events: EventsLike, delta: float) -> float:
        """Upper bound on epsilon at `delta` (the RDP bound, with a PldFallbackWarning, beyond epsilon 100)."""
        delta = _check_delta(delta)
        composition = as_composition(events)
        if composition.steps == 0:
            return 0.0
        fallback = rdp_fallback_epsilon(composition, delta)
        if fallback is not None:
            return fallback
        return float(_pld_of(composition, self.value_interval).get_epsilon_for_delta(delta))

    def delta(self, events: EventsLike, epsilon: float) -> float:
        """Upper bound on delta at `epsilon`."""
        epsilon = _check_epsilon(epsilon)
        composition = as_composition(events)
        if composition.steps == 0:
            return 0.0
        if has_skellam(composition):
            return ACCOUNTANTS["rdp"].delta(composition, epsilon)
        return float(_pld_of(composition, self.value_interval).get_delta_for_epsilon(epsilon))


def _log_add(log_x: float, log_y: float) -> float:
    """dp-accounting's `_log_add`: log(e^x + e^y), as it computes it (the same operations in the same order)."""
    low, high = min(log_x, log_y), max(log_x, log_y)
    return high if low == -math.inf else math.log1p(math.exp(low - high)) + high


# A series of up to this many terms is summed term by term: looking for its restart costs more than it saves.
_SHORT_SERIES = 64


def _log_sum_in_order(terms: np.ndarray) -> float:
    """dp-accounting's running `_log_add` of `terms`, first to last, to the last bit, skipping what it would
    leave unchanged.

    A running sum takes a term far above it as that term exactly: when e^(sum
    - term) is under an eighth of the term's last bit, log1p of it added to
    the term rounds to the term. The sum before term j is at most the largest
    term before it plus log(j) (plus its rounding, a margin of one nat and
    more), so the last term that passes that test for this bound is where the
    sum restarts, whatever came before; from there the terms are added one by
    one, passing over each term whose e^(term - sum) is exactly 0.
    """
    if terms.size == 0:
        return -math.inf
    start = 0
    if terms.size > _SHORT_SERIES:
        before = np.maximum.accumulate(terms)[:-1]
        index = np.arange(1, terms.size, dtype=np.float64)
        bound = before + np.log(index) + 1.0 + 1e-12 * index * (np.abs(before) + 1.0)
        later = terms[1:]
        with np.errstate(divide="ignore"):
            restarts = np.flatnonzero(bound - later <= np.log(np.spacing(np.abs(later)) / 16.0))
        start = int(restarts[-1]) + 1 if restarts.size else 0
    log_sum = float(terms[start])
    exp, log1p = math.exp, math.log1p
    for term in terms[start + 1:].tolist():
        # `_log_add(log_sum, term)` written out: the same operations on the smaller and the larger.
        if term > log_sum:
            log_sum = log1p(exp(log_sum - term)) + term
        elif term > log_sum - 750.0:  # below, e^(term - sum) underflows to 0: the sum is unchanged
            log_sum = log1p(exp(term - log_sum)) + log_sum
    return log_sum


def _integer_order_log_moments(sampling_rate: float, noise_multiplier: float, orders: np.ndarray) -> np.ndarray:
    """log A_order of the Poisson-subsampled Gaussian at each integer order of `orders` (Mironov, Talwar and
    Zhang 2019, Section 3.3):

        A_a = sum over k = 0..a of C(a, k) (1 - q)^(a - k) q^k exp((k^2 - k) / (2 sigma^2)),

    dp-accounting's `_compute_log_a_int` to the last bit: every order's terms
    in one numpy pass (the same operations in the same order, on the same scipy
    gammaln, each of its integer arguments evaluated once), then each order's running log-sum by
    `_log_sum_in_order`.
    """
    sizes = orders.astype(np.int64) + 1
    order = np.repeat(orders, sizes)
    k = np.arange(sizes.sum(), dtype=np.float64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    log_factorials = special.gammaln(np.arange(sizes.max(), dtype=np.float64) + 1)  # gammaln(n + 1) at n
    log_binomials = (log_factorials[order.astype(np.int64)] - log_factorials[k.astype(np.int64)]
                     - log_factorials[(order - k).astype(np.int64)])
    log_coefficients = log_binomials + k * math.log(sampling_rate) + (order - k) * math.log1p(-sampling_rate)
    terms = log_coefficients + (k * k - k) / (2 * (noise_multiplier**2))
    if not np.all(np.isfinite(terms)):  # a noise multiplier so small that the terms overflow: dp-accounting's own
        return np.array([
            rdp.rdp_privacy_accountant._compute_log_a_int(sampling_rate, noise_multiplier, int(alpha))
            for alpha in orders
        ])
    return np.array([_log_sum_in_order(segment) for segment in np.split(terms, np.cumsum(sizes)[:-1])])


# The series of a fractional order mostly ends within this many terms (ten or twenty at the ledger's usual
# mechanisms); an order whose series runs longer is left to dp-accounting's own loop.
_FRACTIONAL_TERMS = 48


def _fractional_order_log_moments(sampling_rate: float, noise_multiplier: float, orders: np.ndarray) -> np.ndarray:
    """log A_order at each fractional order of `orders`: dp-accounting's `_compute_log_a_frac` (Mironov, Talwar
    and Zhang 2019, Section 3.3) to the last bit, its first _FRACTIONAL_TERMS terms of every order computed in
    one numpy pass (the same operations in the same order), its sums and its stopping rule as it runs them."""
    q, sigma = sampling_rate, noise_multiplier
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log1mq = math.log1p(-q)
    alpha = orders[:, np.newaxis]
    i = np.arange(_FRACTIONAL_TERMS, dtype=np.float64)[np.newaxis, :]
    j = alpha - i
    log_coef = special.gammaln(alpha + 1) - special.gammaln(i + 1) - special.gammaln(j + 1)
    log_t0 = log_coef + i * math.log(q) + j * log1mq
    log_t1 = log_coef + j * math.log(q) + i * log1mq
    log_e0 = math.log(0.5) + (math.log(2) + special.log_ndtr(-((i - z0) / (math.sqrt(2) * sigma)) * 2**0.5))
    log_e1 = math.log(0.5) + (math.log(2) + special.log_ndtr(-((z0 - j) / (math.sqrt(2) * sigma)) * 2**0.5))
    log_s0 = (log_t0 + (i * i - i) / (2 * (sigma**2)) + log_e0).tolist()
    log_s1 = (log_t1 + (j * j - j) / (2 * (sigma**2)) + log_e1).tolist()
    moments = []
    exp, log1p, inf = math.exp, math.log1p, math.inf
    for index in range(len(orders)):
        log_a0 = log_a1 = last_s0 = last_s1 = -inf
        for s0, s1 in zip(log_s0[index], log_s1[index]):
            # `_log_add` written out, for each of the three sums: the same operations on the smaller and the larger.
            log_a0 = s0 if log_a0 == -inf else (
                log1p(exp(log_a0 - s0)) + s0 if s0 > log_a0 else log1p(exp(s0 - log_a0)) + log_a0)
            log_a1 = s1 if log_a1 == -inf else (
                log1p(exp(log_a1 - s1)) + s1 if s1 > log_a1 else log1p(exp(s1 - log_a1)) + log_a1)
            total = _log_add(log_a0, log_a1)
            if s0 < last_s0 and s1 < last_s1 and max(s0, s1) < total - 30:
                break
            last_s0, last_s1 = s0, s1
        else:
            total = rdp.rdp_privacy_accountant._compute_log_a_frac(q, sigma, orders[index])
        moments.append(total)
    return np.array(moments)


@functools.lru_cache(maxsize=4096)
def sampled_gaussian_rdp(sampling_rate: float, noise_multiplier: float) -> np.ndarray:
    """The Renyi divergences of one Poisson-subsampled Gaussian step (sensitivity 1) at every order of RDP_ORDERS,
    as dp-accounting's RdpAccountant computes them, to the last bit (read-only; cached).

    Its series in closed form per order (`_integer_order_log_moments`,
    `_fractional_order_log_moments`), their terms in numpy and only their
    running sums in Python: a new mechanism costs a few milliseconds, not
    dp-accounting's 0.1-0.2 s of Python. The last bit matters: the ledger's
    tallies add and subtract these curves in exact units, and `verify`
    compares them with what earlier commits stored.
    """
    if not 0.0 < sampling_rate < 1.0 or not 0.0 < noise_multiplier < math.inf:  # no sum to take: dp-accounting's
        divergences = rdp.rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(
            sampling_rate, noise_multiplier, RDP_ORDERS
        ).astype(np.float64)
    else:
        integer = RDP_ORDERS == np.floor(RDP_ORDERS)
        divergences = np.empty_like(RDP_ORDERS)
        divergences[integer] = _integer_order_log_moments(
            sampling_rate, noise_multiplier, RDP_ORDERS[integer]
        ) / (RDP_ORDERS[integer] - 1)
        divergences[~integer] = _fractional_order_log_moments(
            sampling_rate, noise_multiplier, RDP_ORDERS[~integer]
        ) / (RDP_ORDERS[~integer] - 1)
    divergences.flags.writeable = False
    return divergences


def rdp_vector(events: EventsLike) -> np.ndarray:
    """Renyi divergences of the composition at every order of RDP_ORDERS.

    RDP composes by addition, so a ledger can keep one running vector per
    dataset and add each job's vector to it.
    """
    total = np.zeros_like(RDP_ORDERS)
    for event in as_composition(events).events:
        if isinstance(event, SampledSkellam):
            step = _skellam_step_rdp(event.mechanism_key)
        else:
            step = sampled_gaussian_rdp(event.sampling_rate, event.effective_noise_multiplier)
        total = total + event.steps * step
    return total


def forget_rdp_curves() -> None:
    """Forget every cached one-step RDP curve, as a new process starts without them."""
    sampled_gaussian_rdp.cache_clear()
    _skellam_step_rdp.cache_clear()


@functools.lru_cache(maxsize=64)
def _skellam_step_rdp(mechanism: tuple[float, float, float, float]) -> np.ndarray:
    # Read-only: callers add it to their own vectors.
    curve = sampled_skellam_rdp(RDP_ORDERS, *mechanism)
    curve.setflags(write=False)
    return curve


def compute_epsilon(orders: Sequence[float], rdp_values: Sequence[float], delta: float) -> tuple[float, float]:
    """dp-accounting's conversion of Renyi divergences at ``orders`` to (epsilon at ``delta``, the best order)."""
    return rdp.rdp_privacy_accountant.compute_epsilon(orders, rdp_values, delta)


def epsilon_from_rdp(rdp_values: np.ndarray, delta: float, warn: bool = True) -> float:
    """Epsilon at `delta` from an RDP vector over RDP_ORDERS (warns at the grid's edge)."""
    delta = _check_delta(delta)
    rdp_values = np.asarray(rdp_values, dtype=np.float64)
    if not np.any(rdp_values):
        return 0.0
    epsilon, order = compute_epsilon(RDP_ORDERS, rdp_values, delta)
    if warn and epsilon > 0 and order in (RDP_ORDERS[0], RDP_ORDERS[-1]):
        warnings.warn(
            f"the best RDP order ({order:g}) is at the edge of the grid "
            f"[{RDP_ORDERS[0]:g}, {RDP_ORDERS[-1]:g}]; the RDP epsilon may be loose, prefer --accountant pld",
            RdpOrderWarning,
            stacklevel=2,
        )
    return float(epsilon)


class RdpAccountant:
    """Renyi-DP accounting over RDP_ORDERS, converted to (epsilon, delta) (rigorous)."""

    name = "rdp"
    rigorous = True

    def epsilon(self, events: EventsLike, delta: float) -> float:
        """Upper bound on epsilon at `delta`."""
        return epsilon_from_rdp(rdp_vector(events), delta)

    def delta(self, events: EventsLike, epsilon: float) -> float:
        """Upper bound on delta at `epsilon`."""
        epsilon = _check_epsilon(epsilon)
        composition = as_composition(events)
        if composition.steps == 0:
            return 0.0
        delta, _ = rdp.rdp_privacy_accountant.compute_delta(RDP_ORDERS, rdp_vector(composition), epsilon)
        return float(delta)


def gdp_mu(events: EventsLike) -> float:
    """Gaussian-DP parameter mu of the composition by the Poisson CLT of Bu et al.

    Per record: mu^2 = steps * q^2 * (e^(1/s^2) - 1), with s the effective noise
    multiplier; records compose as the root of the sum of squares.
    """
    total = 0.0
    for event in as_composition(events).events:
        exponent = event.effective_noise_multiplier**-2
        growth = math.expm1(exponent) if exponent < 700.0 else math.inf
        total += event.steps * event.sampling_rate**2 * growth
    return math.sqrt(total)


def gdp_delta(mu: float, epsilon: float) -> float:
    """delta(epsilon) of mu-GDP: Phi(-eps/mu + mu/2) - e^eps * Phi(-eps/mu - mu/2)."""
    if mu == 0.0:
        return 0.0
    first = special.ndtr(-epsilon / mu + mu / 2.0)
    # The second term is at most the first, so its log is <= 0; at a huge mu the sum of two huge numbers can round
    # above that (and overflow exp).
    second = math.exp(min(0.0, epsilon + special.log_ndtr(-epsilon / mu - mu / 2.0)))
    return max(0.0, float(first - second))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon with gdp_delta(mu, epsilon) <= delta."""
    if mu == 0.0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    if not math.isfinite(mu):
        return math.inf
    upper = 1.0
    while gdp_delta(mu, upper) > delta:
        upper *= 2.0
    return float(optimize.brentq(lambda eps: gdp_delta(mu, eps) - delta, 0.0, upper, xtol=1e-12))


class GdpAccountant:
    """Central-limit Gaussian-DP approximation (Bu et al.); NOT a rigorous bound."""

    name = "gdp"
    rigorous = False

    def epsilon(self, events: EventsLike, delta: float) -> float:
        """Approximate epsilon at `delta`; may be below the true value."""
        return gdp_epsilon(gdp_mu(events), _check_delta(delta))

    def delta(self, events: EventsLike, epsilon: float) -> float:
        """Approximate delta at `epsilon`; may be below the true value."""
        return gdp_delta(gdp_mu(events), _check_epsilon(epsilon))


ACCOUNTANTS: dict[str, Accountant] = {
    accountant.name: accountant for accountant in (PldAccountant(), RdpAccountant(), GdpAccountant())
}


def get_accountant(name: str) -> Accountant:
    """The accountant called `name` (pld, rdp or gdp)."""
    try:
        return ACCOUNTANTS[name]
    except KeyError:
        raise AccountingError(
            f"unknown accountant {name!r}; choose one of {', '.join(ACCOUNTANTS)}"
        ) from None


def label(accountant: Accountant) -> str:
    """How a figure from this accountant is shown: its name, marked when approximate."""
    return accountant.name if accountant.rigorous else f"{accountant.name} (approximate)"


PLD_FALLBACK_LABEL = "rdp bound; pld impractical past epsilon 100"
SKELLAM_LABEL = "rdp bound of the silos' skellam noise"


def labelled_epsilon(accountant: Accountant, events: EventsLike, delta: float) -> tuple[float, str]:
    """Epsilon at `delta` and the label to show it with: ``label(accountant)``, or PLD_FALLBACK_LABEL.

    The PLD accountant answers with the RDP bound where its grid is
    impractical; the label then says so, in place of its PldFallbackWarning
    (a training run asks every step). Other warnings are passed on. Events
    with Skellam noise from silos have only an RDP bound: SKELLAM_LABEL.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = accountant.epsilon(events, delta)
    fell_back = False
    for warning in caught:
        if issubclass(warning.category, PldFallbackWarning):
            fell_back = True
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if accountant.rigorous and has_skellam(events):
        return value, SKELLAM_LABEL
    return value, PLD_FALLBACK_LABEL if fell_back else label(accountant)
