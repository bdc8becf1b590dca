"""Correlated-noise (matrix factorization) mechanisms: their strategies, sensitivities and errors (pure math).

Training releases the prefix sums A·x of the clipped gradient sums x_0..x_{n-1}
(A: the lower-triangular all-ones matrix). A matrix mechanism factors A = B·C,
releases C·x + z with z ~ N(0, σ²·Δ²) (Δ: the sensitivity of C·x) and
post-processes: the optimizer sees x_t + (C⁻¹z)_t at step t, noise that is
correlated across steps. DP-SGD is C = I.

- BandMF (Choquette-Choo et al. 2023; McKenna et al. 2024): C lower-triangular,
  Toeplitz, with b bands, its coefficients chosen by scipy to minimise the
  expected squared error of the prefix sums at unit column norm. The noise of
  step t needs only the last b - 1 noise vectors (`banded_inverse_noise`).
- DP-FTRL (Kairouz et al. 2021): C is the binary tree over the steps; the noise
  of prefix t is the sum of the tree nodes that cover 0..t (`tree_nodes`).

Sensitivity is that of one example over its participation pattern: with
fixed-order epochs, an example joins once every `steps_per_epoch` steps, and
for a b-banded C with separation >= b the columns it touches do not overlap,
so Δ = sqrt(k) · (largest column norm). Nothing here knows about models,
Ray or keys.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import numpy as np

from dataclasses import dataclass

from accounting.events import CORRELATED_MECHANISMS, Composition, CorrelatedGaussian
from accounting.lazy import LazyModule

optimize = LazyModule("scipy.optimize")
signal = LazyModule("scipy.signal")

MECHANISMS = ("dp-sgd", *CORRELATED_MECHANISMS)
# How each step's batch is drawn: Poisson over the data (DP-SGD), one fixed shuffled order cycled through every
# epoch (no amplification), or Poisson within one of b groups taken in turn (amplified BandMF).
SAMPLERS = ("poisson", "fixed-order", "cyclic-poisson")

# The log error the optimiser sees where C⁻¹ overflows: far above any stable strategy's (e^1000).
_UNSTABLE_LOG_ERROR = 1000.0
# Bumped whenever the optimisation changes, so that a cache never serves an older optimum.
_STRATEGY_VERSION = 2


class StrategyError(ValueError):
    """A strategy was asked for with parameters outside their valid range."""


def prefix_workload(steps: int) -> np.ndarray:
    """A: the `steps` x `steps` lower-triangular all-ones matrix, whose rows are the prefix sums."""
    return np.tril(np.ones((steps, steps)))


def toeplitz_matrix(coefficients: np.ndarray, steps: int) -> np.ndarray:
    """The `steps` x `steps` lower-triangular Toeplitz matrix with c_i on its i-th subdiagonal (bands beyond are 0)."""
    matrix = np.zeros((steps, steps))
    for band, value in enumerate(np.asarray(coefficients, dtype=np.float64)[:steps]):
        matrix += value * np.eye(steps, k=-band)
    return matrix


def inverse_coefficients(coefficients: np.ndarray, steps: int) -> np.ndarray:
    """The first `steps` coefficients of C⁻¹ for a lower-triangular Toeplitz C (itself Toeplitz).

    The impulse response of 1/c(z): d_0 = 1/c_0, d_k = -(Σ_{i>=1} c_i d_{k-i}) / c_0.
    """
    impulse = np.zeros(steps)
    impulse[0] = 1.0
    return signal.lfilter([1.0], np.asarray(coefficients, dtype=np.float64), impulse)


def _prefix_error_and_gradient(coefficients: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    """||A C⁻¹||_F² for the Toeplitz C of `coefficients`, and its gradient in the coefficients.

    A C⁻¹ is Toeplitz with coefficients e = cumsum(d) (d: C⁻¹'s), and its k-th
    diagonal has steps - k entries. d(d)/dc_j is -(d*d) shifted by j.
    """
    inverse = inverse_coefficients(coefficients, steps)
    prefix = np.cumsum(inverse)
    weights = np.arange(steps, 0, -1, dtype=np.float64)
    error = float(np.sum(weights * prefix**2))
    squared = np.convolve(inverse, inverse)[:steps]
    squared_prefix = np.cumsum(squared)
    weighted = weights * prefix
    gradient = np.array([-2.0 * np.dot(weighted[band:], squared_prefix[:steps - band])
                         for band in range(len(coefficients))])
    return error, gradient


def _square_root_coefficients(bands: int) -> np.ndarray:
    """The first `bands` coefficients of (1 - z)^(-1/2), A's Toeplitz square root (Fichtenberger et al. 2023)."""
    values = np.ones(bands)
    for index in range(1, bands):
        values[index] = values[index - 1] * (2 * index - 1) / (2 * index)
    return values


def _check_strategy(steps: int, epochs: int, bands: int) -> None:
    for name, value in (("steps", steps), ("epochs", epochs), ("band_width", bands)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise StrategyError(f"{name} must be an integer >= 1 (got {value!r})")
    if bands > steps:
        raise StrategyError(f"band_width must be at most the run's steps, {steps} (got {bands})")


def _strategy_cache_dir() -> Path:
    """Where optimised strategies are kept between processes: $DPFLEET_CACHE_DIR, else the user's cache dir."""
    root = os.environ.get("DPFLEET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dpfleet")
    return Path(root) / "strategies"


def _optimise_band_coefficients(steps: int, bands: int) -> np.ndarray:
    """Unit-norm Toeplitz band coefficients minimising ||A C⁻¹||_F², by L-BFGS from the square root's."""
    if bands == 1:
        return np.ones(1)
    start = _square_root_coefficients(bands)

    def objective(raw: np.ndarray) -> tuple[float, np.ndarray]:
        # The column-norm constraint is kept by optimising over directions: c = raw / |raw|; the log of the error
        # keeps the gradient's scale the same for every n.
        norm = float(np.linalg.norm(raw))
        coefficients = raw / norm
        with np.errstate(over="ignore", invalid="ignore"):
            error, gradient = _prefix_error_and_gradient(coefficients, steps)
        if not (np.isfinite(error) and error > 0 and np.all(np.isfinite(gradient))):
            # An unstable C⁻¹ (a root of c(z) inside the unit circle) grows without bound: the line search backs off.
            return _UNSTABLE_LOG_ERROR, np.zeros_like(raw)
        gradient = gradient / error
        return math.log(error), (gradient - np.dot(gradient, coefficients) * coefficients) / norm

    result = optimize.minimize(objective, start / np.linalg.norm(start), jac=True, method="L-BFGS-B",
                               options={"maxiter": 1000})
    best = result.x / np.linalg.norm(result.x)
    if best[0] < 0:
        best = -best
    # Never worse than where it started: the square root's coefficients are a valid strategy too.
    initial = start / np.linalg.norm(start)
    if _prefix_error_and_gradient(initial, steps)[0] < _prefix_error_and_gradient(best, steps)[0]:
        return initial
    return best


@functools.lru_cache(maxsize=64)
def band_coefficients(steps: int, epochs: int, bands: int) -> tuple[float, ...]:
    """The BandMF strategy for `steps` steps in `epochs` fixed-order epochs with `bands` bands: C's coefficients.

    C is b-banded lower-triangular Toeplitz with unit column norm; its
    coefficients minimise the expected squared error of the prefix sums. With
    separation >= b every column an example touches is a full one, so the
    epochs scale every strategy's sensitivity alike and do not change the
    optimum; they are part of the cache key all the same. Kept in memory and
    in a JSON file per (steps, epochs, b) under the user's cache directory.
    """
    _check_strategy(steps, epochs, bands)
    name = f"band-v{_STRATEGY_VERSION}-{steps}-{epochs}-{bands}.json"
    path = _strategy_cache_dir() / name
    try:
        cached = json.loads(path.read_text())
        coefficients = np.array(cached["coefficients"], dtype=np.float64)
        if len(coefficients) == bands and abs(np.linalg.norm(coefficients) - 1.0) < 1e-9:
            return tuple(float(value) for value in coefficients)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    coefficients = _optimise_band_coefficients(steps, bands)
    coefficients = coefficients / np.linalg.norm(coefficients)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"steps": steps, "epochs": epochs, "band_width": bands,
                                         "coefficients": [float(value) for value in coefficients]}))
        temporary.replace(path)
    except OSError:
        pass  # A read-only home only costs the optimisation again next time.
    return tuple(float(value) for value in coefficients)


def column_norms(strategy: np.ndarray) -> np.ndarray:
    """The L2 norm of each column of a strategy matrix."""
    return np.linalg.norm(strategy, axis=0)


def fixed_order_patterns(steps: int, steps_per_epoch: int) -> list[np.ndarray]:
    """The steps at which each position of a fixed-order run takes part: i, i + s, i + 2s, ... below `steps`."""
    return [np.arange(position, steps, steps_per_epoch) for position in range(min(steps_per_epoch, steps))]


def pattern_sensitivity(strategy: np.ndarray, patterns: list[np.ndarray]) -> float:
    """max over the patterns of ||C·u||, u the pattern's indicator: one example's largest effect, in clip norms.

    Exact for strategies whose columns have non-negative inner products
    (every one here: a same-direction gradient at every participation is the
    worst case); for a banded C and separation >= b it is sqrt(k) · max
    column norm.
    """
    return max(float(np.linalg.norm(strategy[:, pattern].sum(axis=1))) for pattern in patterns)


def banded_sensitivity(coefficients, participations: int) -> float:
    """Δ of a banded Toeplitz strategy for `participations` participations with separation >= b."""
    return math.sqrt(participations) * float(np.linalg.norm(coefficients))


def banded_inverse_noise(coefficients, unit_noise: np.ndarray) -> np.ndarray:
    """Rows of C⁻¹Z for the banded Toeplitz C of `coefficients`, by the recursion w_t = (z_t - Σ c_i w_{t-i}) / c_0.

    `unit_noise` holds z_0..z_{n-1} as rows. The recursion is what the driver
    runs one step at a time (`BandedNoise`); this is its reference over a
    whole run.
    """
    coefficients = np.asarray(coefficients, dtype=np.float64)
    correlated = np.zeros_like(np.asarray(unit_noise, dtype=np.float64))
    for step in range(len(unit_noise)):
        value = np.array(unit_noise[step], dtype=np.float64)
        for band in range(1, min(len(coefficients), step + 1)):
            value -= coefficients[band] * correlated[step - band]
        correlated[step] = value / coefficients[0]
    return correlated


def tree_levels(leaves: int) -> int:
    """Levels of the binary tree over `leaves` leaves (a leaf lies in this many nodes): ceil(log2 leaves) + 1."""
    return max(1, math.ceil(math.log2(leaves))) + 1 if leaves > 1 else 1


def tree_nodes(position: int, leaves: int, complete: bool = False) -> list[tuple[int, int]]:
    """The (level, index) tree nodes whose sum is the prefix 0..`position` of a tree over `leaves` leaves.

    The dyadic decomposition: one node per set bit of position + 1. With
    `complete` (Kairouz et al. 2021's tree completion), the last leaf's
    prefix is the root alone, the tree being padded with zero leaves to a
    power of two: one node's noise instead of up to log2 of them.
    """
    if not 0 <= position < leaves:
        raise StrategyError(f"position must be in 0..{leaves - 1} (got {position})")
    if complete and position == leaves - 1:
        return [(tree_levels(leaves) - 1, 0)]
    nodes = []
    count = position + 1
    start = 0
    for level in reversed(range(count.bit_length())):
        if count >> level & 1:
            nodes.append((level, start >> level))
            start += 1 << level
    return nodes


def tree_strategy(leaves: int) -> np.ndarray:
    """C of the binary tree: one row per node (level, index), one column per leaf; 1 where the node covers it."""
    levels = tree_levels(leaves)
    rows = []
    for level in range(levels):
        for index in range(math.ceil(leaves / (1 << level))):
            row = np.zeros(leaves)
            row[index << level:min(leaves, (index + 1) << level)] = 1.0
            rows.append(row)
    return np.array(rows)


def tree_sensitivity(leaves: int) -> float:
    """Δ of one tree for one participation per tree: sqrt(levels) (each leaf lies in `levels` nodes)."""
    return math.sqrt(tree_levels(leaves))


def tree_prefix_noise(unit_nodes: dict[tuple[int, int], np.ndarray], position: int, leaves: int,
                      complete: bool = False) -> np.ndarray:
    """The noise of the prefix 0..`position`: the sum of its `tree_nodes`' noise (`unit_nodes` by (level, index))."""
    return sum(unit_nodes[node] for node in tree_nodes(position, leaves, complete))


def banded_prefix_rmse(coefficients, steps: int, sensitivity: float, noise_multiplier: float) -> float:
    """RMSE of the n prefix sums, in clip norms: σ·Δ·||A C⁻¹||_F / sqrt(n) (per coordinate)."""
    error, _ = _prefix_error_and_gradient(np.asarray(coefficients, dtype=np.float64), steps)
    return noise_multiplier * sensitivity * math.sqrt(error / steps)


def tree_prefix_rmse(steps: int, sensitivity: float, noise_multiplier: float, complete: bool = False) -> float:
    """RMSE of the n prefix sums of one tree, in clip norms: σ·Δ·sqrt(mean node count of a prefix)."""
    nodes = [len(tree_nodes(position, steps, complete)) for position in range(steps)]
    return noise_multiplier * sensitivity * math.sqrt(sum(nodes) / steps)


def fixed_order_tree_sensitivities(steps: int, steps_per_epoch: int) -> list[float]:
    """Δ of one binary tree over all `steps` for the first 1, 2, ... epochs of fixed-order participation.

    An example at position i takes part at i, i + s, ...; the nodes its
    leaves share add up, so Δ_e² = max_i Σ_node (its leaves' count in that
    node)². Computed by counting nodes, without the tree's matrix.
    """
    levels = tree_levels(steps)
    epochs = math.ceil(steps / steps_per_epoch)
    best = [0.0] * epochs
    for position in range(min(steps_per_epoch, steps)):
        counts: dict[tuple[int, int], int] = {}
        total = 0
        for epoch, leaf in enumerate(range(position, steps, steps_per_epoch)):
            for level in range(levels):
                node = (level, leaf >> level)
                before = counts.get(node, 0)
                counts[node] = before + 1
                total += 2 * before + 1
            best[epoch] = max(best[epoch], float(total))
        for epoch in range(len(range(position, steps, steps_per_epoch)), epochs):
            best[epoch] = max(best[epoch], float(total))
    return [math.sqrt(value) for value in best]


@dataclass(frozen=True)
class CorrelatedNoisePlan:
    """What a correlated-noise run does, from its config and N: strategy, participation and per-step charges.

    `sampler` is "fixed-order" (each example once per epoch of
    `steps_per_epoch` steps, no amplification) or "cyclic-poisson" (band-mf
    only: group t mod b is Poisson-sampled at `participation_rate` at step t).
    """

    mechanism: str
    sampler: str
    steps: int
    steps_per_epoch: int
    band_width: int = 1
    participation_rate: float = 1.0
    tree_restart: bool = True
    tree_completion: bool = False

    def __post_init__(self) -> None:
        if self.mechanism not in CORRELATED_MECHANISMS:
            raise StrategyError(f"mechanism must be one of {', '.join(CORRELATED_MECHANISMS)} "
                                f"(got {self.mechanism!r})")
        refusal = sampler_refusal(self.mechanism, self.sampler)
        if refusal:
            raise StrategyError(refusal)
        _check_strategy(self.steps, 1, self.band_width)
        if self.sampler == "fixed-order" and self.band_width > self.steps_per_epoch:
            raise StrategyError(
                f"band_width must be at most the steps of one epoch, {self.steps_per_epoch}, so that an example's "
                f"participations are b steps apart (got {self.band_width}); lower band_width or raise the batch count")

    @property
    def amplified(self) -> bool:
        """Whether participation is Poisson-sampled (cyclic Poisson), so that the reduction amplifies it."""
        return self.sampler == "cyclic-poisson"

    @property
    def period(self) -> int:
        """Training steps between two participations of one example: b (cyclic Poisson) or one epoch."""
        return self.band_width if self.amplified else self.steps_per_epoch

    @property
    def tree_leaves(self) -> int:
        """Leaves of each DP-FTRL tree: one epoch's steps with restarts, else the whole run's."""
        return min(self.steps_per_epoch, self.steps) if self.tree_restart else self.steps

    @functools.cached_property
    def coefficients(self) -> tuple[float, ...]:
        """BandMF's strategy coefficients (unit column norm); (1.0,) for DP-FTRL, which has no band."""
        if self.mechanism != "band-mf":
            return (1.0,)
        return band_coefficients(self.steps, math.ceil(self.steps / self.steps_per_epoch), self.band_width)

    @functools.cached_property
    def participation_factors(self) -> tuple[float, ...]:
        """The sensitivity factor charged at each participation (their squares add up to Δ²), in order."""
        count = math.ceil(self.steps / self.period)
        if self.mechanism == "band-mf":
            return (float(np.linalg.norm(self.coefficients)),) * count
        if self.tree_restart:
            return (tree_sensitivity(self.tree_leaves),) * count
        cumulative = fixed_order_tree_sensitivities(self.steps, self.steps_per_epoch)
        squares = np.diff(np.square([0.0, *cumulative]))
        return tuple(float(math.sqrt(max(0.0, value))) for value in squares)

    @property
    def sensitivity(self) -> float:
        """Δ of the whole release in clip norms (without amplification): sqrt of the sum of the factors²."""
        return math.sqrt(sum(factor**2 for factor in self.participation_factors))

    def events_between(self, noise_multiplier: float, start: int, end: int) -> Composition:
        """The events of steps start..end-1: a participation is charged at the first step of its period.

        Charged at its start, a participation is accounted before any step
        that could reveal it, so every prefix of the run is covered.
        """
        first = math.ceil(start / self.period)
        last = math.ceil(min(end, self.steps) / self.period)
        band = self.band_width if self.mechanism == "band-mf" else self.tree_leaves
        return Composition(tuple(
            CorrelatedGaussian(self.participation_rate, noise_multiplier, 1, factor, self.mechanism, band,
                               self.period)
            for factor in self.participation_factors[first:last]))

    def events(self, noise_multiplier: float) -> Composition:
        """The events of the whole run."""
        return self.events_between(noise_multiplier, 0, self.steps)

    def prefix_rmse(self, noise_multiplier: float) -> float:
        """RMSE of the run's prefix sums per coordinate, in clip norms, at `noise_multiplier` (one tree's with
        restarts)."""
        if self.mechanism == "band-mf":
            return banded_prefix_rmse(self.coefficients, self.steps, 1.0, noise_multiplier)
        return tree_prefix_rmse(self.tree_leaves, 1.0, noise_multiplier, self.tree_completion)


def sampler_refusal(mechanism: str, sampler: str) -> str | None:
    """Why `sampler` does not match `mechanism`'s accounting, or None when it does."""
    if mechanism == "dp-sgd" and sampler != "poisson":
        return (f'mechanism "dp-sgd" is accounted as Poisson sampling, so it needs sampler = "poisson" '
                f'(got "{sampler}"); for fixed-order participation choose mechanism = "band-mf" or "dp-ftrl"')
    if mechanism == "dp-ftrl" and sampler != "fixed-order":
        return (f'mechanism "dp-ftrl" (tree aggregation) is accounted without amplification over fixed-order '
                f'epochs, so it needs sampler = "fixed-order" (got "{sampler}")')
    if mechanism == "band-mf" and sampler == "poisson":
        return ('mechanism "band-mf" has no amplification by plain Poisson sampling across bands; choose '
                'sampler = "cyclic-poisson" (amplified, Choquette-Choo et al. 2023) or "fixed-order" (unamplified)')
    return None


def decorrelated_observations(plan: CorrelatedNoisePlan, observations: np.ndarray,
                              noise_multiplier: float) -> tuple[np.ndarray, np.ndarray]:
    """Released noisy sums at some coordinates ([steps, coordinates]) as an auditor scores them: with noise
    independent from step to step, and each step's noise multiplier.

    BandMF: C times the released sequence is C·x + σ·z, z independent
    (a canary's participation spreads over its column's b rows). DP-FTRL: the
    released sums as they are; step t's noise is the nodes in which the
    prefixes t and t - 1 differ, so its multiplier is σ·sqrt(their count).
    Any score gives a valid one-run lower bound; these keep it close to the
    DP-SGD score, which they are for b = 1.
    """
    observations = np.asarray(observations, dtype=np.float64)
    steps = len(observations)
    if plan.mechanism == "band-mf":
        return toeplitz_matrix(plan.coefficients, steps) @ observations, np.full(steps, noise_multiplier)
    multipliers = np.empty(steps)
    leaves = plan.tree_leaves
    for step in range(steps):
        tree, position = divmod(step, leaves) if plan.tree_restart else (0, step)
        tree_leaves = min(leaves, plan.steps - tree * leaves)
        nodes = set(tree_nodes(position, tree_leaves, plan.tree_completion))
        before = set(tree_nodes(position - 1, tree_leaves, plan.tree_completion)) if position else set()
        multipliers[step] = noise_multiplier * math.sqrt(len(nodes ^ before))
    return observations, multipliers
