"""A job's plan from its config: N, q, steps, the σ blocks (calibrated to a target ε if asked) and the events they run.

Planning reads the data's size from metadata and the accountants' ε, never a
model or an example, so it loads no torch or Ray: `dpfleet ledger fits` plans
a job as `dpfleet train` does and answers at once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

from accounting.calibration import scale_for_epsilon, scale_for_target
from accounting.events import Composition, skellam_events
from accounting.skellam import SILO_NOISE_ROUNDING_RATIO
from accounting.matrix_mechanisms import CorrelatedNoisePlan, StrategyError
from orchestrator import checks
from orchestrator.adaptive_clipping import effective_noise_multiplier
from orchestrator.config import (
    EvaluateEvery,
    TrainConfig,
    expected_batch_size,
    rows_per_person,
    sampled_unit_count,
    sampling_rate,
    total_steps,
)
from orchestrator.errors import UsageError
from orchestrator.sampling import microbatch_count
from orchestrator.schedules import noise_blocks, schedule_events


@dataclass(frozen=True)
class RunPlan:
    """What a configuration will run: derived once, before any worker starts."""

    dataset_size: int
    sampling_rate: float
    expected_batch_size: float
    steps: int
    noise_multiplier: float
    noise_blocks: tuple[tuple[float, int], ...]
    epoch_ends: tuple[int, ...]
    evaluation_steps: frozenset[int]
    charge_ends: tuple[int, ...]
    microbatches: int | None = None
    count_noise_multiplier: float | None = None
    privacy_unit: str = "example"
    rows_per_person: int | None = None
    correlation: CorrelatedNoisePlan | None = None
    batch_size: int | None = None
    # With noise_placement = "silos": r, the bound on sqrt(d) / (s·C) of the silos' Skellam noise (None: the driver).
    rounding_ratio: float | None = None

    @property
    def sampler(self) -> str:
        """How each step's batch is drawn: "poisson", or the correlated mechanism's sampler."""
        return "poisson" if self.correlation is None else self.correlation.sampler

    @property
    def sensitivity_factor(self) -> float:
        """2 with microbatches (one example moves one microbatch's clipped gradient by up to 2C), else 1."""
        return 2.0 if self.microbatches else 1.0

    @property
    def contributions_per_step(self) -> float:
        """What the noisy sum is averaged over: q*N examples, or the G microbatches."""
        return float(self.microbatches) if self.microbatches else self.expected_batch_size

    @functools.cached_property
    def planned_events(self) -> Composition:
        """The events of the whole planned run, in order (with adaptive clipping, of the gradient and count pair).

        Cached: the plan is frozen, and every step slices its own event from this.
        """
        if self.correlation is not None:
            return self.correlation.events(self.noise_multiplier)
        events = schedule_events(accounted_blocks(self.noise_blocks, self.count_noise_multiplier), self.sampling_rate,
                                 self.sensitivity_factor)
        return events if self.rounding_ratio is None else skellam_events(events, self.rounding_ratio)

    def events_between(self, start: int, end: int) -> Composition:
        """The events of steps start..end-1 (0-based) of the plan (a correlated mechanism's participations that
        start there)."""
        if self.correlation is not None:
            return self.correlation.events_between(self.noise_multiplier, start, end)
        return steps_between(self.planned_events, start, end)

    @functools.cached_property
    def row_level_events(self) -> Composition:
        """The planned events as a budget over rows counts them: what the ledger reserves and charges.

        At example level, `planned_events`. Under privacy_unit = "user", one
        row changes its own user's clipped contribution by up to 2C, and that
        user takes part with probability q: the sampled Gaussian at sensitivity
        factor 2 bounds what one row reveals.
        """
        if self.privacy_unit == "example":
            return self.planned_events
        return schedule_events(list(self.noise_blocks), self.sampling_rate, 2.0)

    def row_level_events_between(self, start: int, end: int) -> Composition:
        """`row_level_events` of steps start..end-1 (0-based)."""
        if self.privacy_unit == "example":
            return self.events_between(start, end)
        return steps_between(self.row_level_events, start, end)

    def ledger_plan(self, dataset_unit: str, start: int = 0) -> tuple[Composition, str, int | None]:
        """What to reserve on a ledger dataset of `dataset_unit`: (events, the unit they protect, rows per person).

        A user-level run reserves its per-user events on a user-level dataset
        and its row-level events on an example-level one. An example-level run
        reserves its events with its rows-per-person bound, which a user-level
        dataset turns into a group-privacy charge (and refuses without one).
        The events are those of steps `start` (0-based) to the end: a resumed
        run whose reservation is gone reserves the steps its ledger did not
        charge.
        """
        if self.privacy_unit == "user":
            if dataset_unit == "user":
                events, unit, rows_per_person = self.planned_events, "user", None
            else:
                events, unit, rows_per_person = self.row_level_events, "example", None
        else:
            events, unit, rows_per_person = self.planned_events, "example", self.rows_per_person
        return events.split(start)[1], unit, rows_per_person

    def sigma_at(self, step: int) -> float:
        """The noise multiplier of step `step` (0-based)."""
        for sigma, steps in self.noise_blocks:
            if step < steps:
                return sigma
            step -= steps
        raise IndexError(f"step {step} is past the planned run")


def steps_between(events: Composition, start: int, end: int) -> Composition:
    """The events of steps start..end-1 (0-based) of a composition of per-step events."""
    before_end, _ = events.split(end)
    return before_end.split(start)[1]


def accounted_blocks(
    blocks: tuple[tuple[float, int], ...] | list[tuple[float, int]], count_noise_multiplier: float | None
) -> list[tuple[float, int]]:
    """The (sigma, steps) blocks as accounted: with adaptive clipping, sigma of the gradient and count pair."""
    if count_noise_multiplier is None:
        return list(blocks)
    return [(effective_noise_multiplier(sigma, count_noise_multiplier), steps) for sigma, steps in blocks]


def correlated_noise_plan(config: TrainConfig, dataset_size: int, steps: int) -> CorrelatedNoisePlan | None:
    """The correlated mechanism's plan (strategy, participation, charges) for N = `dataset_size`; None for DP-SGD."""
    if config.mechanism == "dp-sgd":
        return None
    steps_per_epoch = dataset_size // config.batch_size
    participation_rate = 1.0
    if config.sampler == "cyclic-poisson":
        if config.band_width * config.batch_size > dataset_size:
            raise UsageError(f"cyclic-poisson samples each of band_width = {config.band_width} groups of N / b "
                             f"examples at rate b·batch_size/N, so band_width·batch_size must be at most N = "
                             f"{dataset_size} (got {config.band_width * config.batch_size}); lower band_width "
                             "or batch_size")
        # The N mod b examples left over join no group (as jax_privacy accounts it): q = B / (N // b).
        participation_rate = config.batch_size / (dataset_size // config.band_width)
    try:
        return CorrelatedNoisePlan(config.mechanism, config.sampler, steps, steps_per_epoch, config.band_width,
                                   participation_rate, config.tree_restart, config.tree_completion)
    except StrategyError as error:
        raise UsageError(str(error)) from None


def evaluation_steps(
    evaluate_every: EvaluateEvery | None, steps: int, steps_per_epoch: float, epoch_ends: list[int]
) -> frozenset[int]:
    """The steps after which the test split is evaluated: every epoch end by default, and always the last step."""
    if evaluate_every is None:
        return frozenset(epoch_ends)
    interval = evaluate_every.steps or max(1, round(evaluate_every.epochs * steps_per_epoch))
    return frozenset(range(interval, steps, interval)) | {steps}


# A default ledger block: this many steps, or 1% of the run where that is more (see default_block_steps).
DEFAULT_BLOCK_STEPS = 100
DEFAULT_BLOCKS_PER_RUN = 100


def default_block_steps(steps: int) -> int:
    """The steps of a ledger block when commit_every is not set: 100, or 1% of the run's `steps` where that is more.

    A run that stops for good keeps the blocks the charge clock charged
    ahead of its steps (orchestrator/charge_clock.py), so blocks are small;
    1% keeps a long run to about 100 commits.
    """
    return max(DEFAULT_BLOCK_STEPS, math.ceil(steps / DEFAULT_BLOCKS_PER_RUN))


def plan_run(
    config: TrainConfig, dataset_size: int | None = None, charge_epsilon: Callable[[RunPlan], float] | None = None
) -> RunPlan:
    """Derive N, q, steps, the sigma blocks (calibrated to target_epsilon if asked) and epoch ends.

    `dataset_size` is N as a sharded run's workers report it; without it, N
    comes from the config. Under privacy_unit = "user", N counts users, and
    target_epsilon is the ε per user. With target_epsilon_basis = "filter",
    σ is the smallest whose `charge_epsilon(plan)` (the RDP-filter ε the
    ledger charges, see ledger_session.filter_charges) meets the target.
    """
    if dataset_size is None:
        dataset_size = sampled_unit_count(config)
    else:
        checks.batch_within_dataset("batch_size", config.batch_size, dataset_size)
    rate = sampling_rate(config, dataset_size)
    steps = total_steps(config, dataset_size)
    steps_per_epoch = dataset_size / config.batch_size

    microbatches = None if config.microbatch_size is None else microbatch_count(
        expected_batch_size(config, dataset_size), config.microbatch_size)
    sensitivity_factor = 2.0 if microbatches else 1.0
    adaptive = config.adaptive_clipping
    count_noise_multiplier = None if adaptive is None else adaptive.count_noise_multiplier

    def blocks_at(noise_multiplier: float) -> list[tuple[float, int]]:
        return noise_blocks(config.noise_schedule, noise_multiplier, steps, steps_per_epoch)

    epoch_ends = sorted({min(steps, math.ceil(epoch * steps_per_epoch - 1e-9))
                         for epoch in range(1, math.ceil(steps / steps_per_epoch - 1e-9) + 1)} | {steps})
    block_steps = config.commit_every or default_block_steps(steps)
    charge_ends = sorted(set(range(block_steps, steps, block_steps)) | {steps})

    rounding_ratio = SILO_NOISE_ROUNDING_RATIO if config.noise_placement == "silos" else None
    correlation = correlated_noise_plan(config, dataset_size, steps)
    if correlation is not None:
        # A correlated run's events are its participations, one at the start of each period: every charged block
        # starts at one, so that none is empty.
        period = correlation.period
        charge_ends = sorted({min(steps, math.ceil(end / period) * period) for end in charge_ends} | {steps})

    def plan_at(noise_multiplier: float) -> RunPlan:
        return RunPlan(
            dataset_size, rate, expected_batch_size(config, dataset_size), steps, noise_multiplier,
            tuple(blocks_at(noise_multiplier)), tuple(epoch_ends),
            evaluation_steps(config.evaluate_every, steps, steps_per_epoch, epoch_ends), tuple(charge_ends),
            microbatches, count_noise_multiplier, config.privacy_unit, rows_per_person(config), correlation,
            config.batch_size, rounding_ratio,
        )

    def events_at(sigma: float) -> Composition:
        if correlation is not None:
            return correlation.events(sigma)
        events = schedule_events(accounted_blocks(blocks_at(sigma), count_noise_multiplier), rate, sensitivity_factor)
        return events if rounding_ratio is None else skellam_events(events, rounding_ratio)

    noise_multiplier = config.noise_multiplier
    if noise_multiplier is None and config.target_epsilon_basis == "filter":
        if charge_epsilon is None:
            raise UsageError('target_epsilon_basis = "filter" needs the admission rule of the ledger budget the job '
                             "is charged to; dpfleet train and dpfleet ledger fits read it from the ledger")
        noise_multiplier = scale_for_epsilon(config.target_epsilon, lambda sigma: charge_epsilon(plan_at(sigma)))
    elif noise_multiplier is None:
        noise_multiplier = scale_for_target(
            config.target_epsilon, config.delta, events_at, config.accountant,
        )
    return plan_at(noise_multiplier)
