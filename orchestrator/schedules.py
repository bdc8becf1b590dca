"""Noise and learning-rate schedules (pure functions over the run's length).

A noise schedule holds sigma constant over blocks of steps (one epoch by
default) and changes it between blocks, so the run is a short composition of
exactly the mechanisms that ran. (Accounting a different sigma at every one of
thousands of steps would cost minutes per epsilon query and buy nothing: the
block form is exact for what it runs.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from accounting.events import Composition, SampledGaussian
from orchestrator import checks
from orchestrator.errors import UsageError

NOISE_SCHEDULES = ("constant", "exponential", "step", "linear")
LR_SCHEDULES = ("constant", "cosine", "step", "exponential")


@dataclass(frozen=True)
class NoiseSchedule:
    """How sigma changes between blocks of `every` steps (None: one epoch per block).

    - constant: sigma_k = sigma
    - exponential: sigma_k = sigma * decay^k (MindArmour's AdaGaussian 'Exp')
    - step: sigma_k = sigma * decay^floor(k / step_size) (Opacus's StepNoise)
    - linear: sigma_k goes linearly from sigma to sigma * final_ratio over the blocks
    """

    kind: str = "constant"
    decay: float = 1.0
    step_size: int = 1
    final_ratio: float = 1.0
    every: int | None = None


@dataclass(frozen=True)
class LearningRateSchedule:
    """How the learning rate changes per step: post-processing, free of privacy cost."""

    kind: str = "constant"
    gamma: float = 1.0
    step_size: int = 1


def _table(name: str, value: Any, allowed: set[str]) -> dict:
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, Mapping):
        raise UsageError(f"{name} must be a kind name or a table with a 'kind' key (got {value!r})")
    unknown = set(value) - allowed - {"kind"}
    if unknown:
        raise UsageError(f"{name} takes kind, {', '.join(sorted(allowed))}; unknown: {', '.join(sorted(unknown))}")
    return dict(value)


def parse_noise_schedule(value: Any) -> NoiseSchedule:
    """Validate the `noise_schedule` config value."""
    table = _table("noise_schedule", value, {"decay", "step_size", "final_ratio", "every"})
    kind = checks.one_of("noise_schedule.kind", table.get("kind", "constant"), NOISE_SCHEDULES)
    decay = checks.positive_number("noise_schedule.decay", table.get("decay", 1.0))
    final_ratio = checks.positive_number("noise_schedule.final_ratio", table.get("final_ratio", 1.0))
    step_size = checks.integer_at_least("noise_schedule.step_size", table.get("step_size", 1), 1)
    every = table.get("every")
    if every is not None:
        every = checks.integer_at_least("noise_schedule.every", every, 1)
    return NoiseSchedule(kind, decay, step_size, final_ratio, every)


def parse_lr_schedule(value: Any) -> LearningRateSchedule:
    """Validate the `lr_schedule` config value."""
    table = _table("lr_schedule", value, {"gamma", "step_size"})
    kind = checks.one_of("lr_schedule.kind", table.get("kind", "constant"), LR_SCHEDULES)
    gamma = checks.positive_number("lr_schedule.gamma", table.get("gamma", 1.0))
    step_size = checks.integer_at_least("lr_schedule.step_size", table.get("step_size", 1), 1)
    return LearningRateSchedule(kind, gamma, step_size)


def noise_blocks(
    schedule: NoiseSchedule, noise_multiplier: float, total_steps: int, steps_per_epoch: float
) -> list[tuple[float, int]]:
    """The run's (sigma, steps) blocks in order; their steps add up to total_steps."""
    every = schedule.every or max(1, math.ceil(steps_per_epoch - 1e-9))
    block_count = math.ceil(total_steps / every)
    blocks = []
    for k in range(block_count):
        steps = min(every, total_steps - k * every)
        if schedule.kind == "exponential":
            factor = schedule.decay**k
        elif schedule.kind == "step":
            factor = schedule.decay ** (k // schedule.step_size)
        elif schedule.kind == "linear":
            factor = 1.0 + (schedule.final_ratio - 1.0) * (k / (block_count - 1) if block_count > 1 else 0.0)
        else:
            factor = 1.0
        blocks.append((noise_multiplier * factor, steps))
    return blocks


def schedule_events(
    blocks: list[tuple[float, int]], sampling_rate: float, sensitivity_factor: float = 1.0
) -> Composition:
    """The DP events of running the blocks at sampling rate q."""
    return Composition(
        tuple(SampledGaussian(sampling_rate, sigma, steps, sensitivity_factor) for sigma, steps in blocks)
    )
