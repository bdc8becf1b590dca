"""Noise and learning-rate schedules (pure functions over the run's length).

A noise schedule holds sigma constant over blocks of steps (one epoch by
default) and changes it between blocks, so the run is a short composition of
exactly the mechanisms that ran. (Accounting a different sigma at every one of
thousands of steps would cost minutes per epsilon query and buy nothing: the
block form is exact for what it runs.)
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from accounting.events import Composition, SampledGaussian
from orchestrator.table import table

NOISE_SCHEDULES = ("constant", "exponential", "step", "linear")
LR_SCHEDULES = ("constant", "cosine", "step", "exponential")


@table
class NoiseSchedule:
    """How sigma changes between blocks of `every` steps (None: one epoch per block).

    - constant: sigma_k = sigma
    - exponential: sigma_k = sigma * decay^k (MindArmour's AdaGaussian 'Exp')
    - step: sigma_k = sigma * decay^floor(k / step_size) (Opacus's StepNoise)
    - linear: sigma_k goes linearly from sigma to sigma * final_ratio over the blocks
    """

    kind: Literal[NOISE_SCHEDULES] = Field("constant", description="How σ changes from one block to the next.")
    decay: float = Field(
        1.0, gt=0, description="exponential: σ·decay^k in block k; step: σ·decay^⌊k/step_size⌋.")
    step_size: int = Field(1, ge=1, description="step: blocks between two decays.")
    final_ratio: float = Field(1.0, gt=0, description="linear: the last block's σ over the first's.")
    every: int | None = Field(None, ge=1, description="Steps a block (none: one epoch).")


@table
class LearningRateSchedule:
    """How the learning rate changes per step: post-processing, free of privacy cost."""

    kind: Literal[LR_SCHEDULES] = Field("constant", description="How the learning rate changes per step.")
    gamma: float = Field(1.0, gt=0, description="step and exponential: the factor the learning rate is multiplied by.")
    step_size: int = Field(1, ge=1, description="step: steps between two multiplications by gamma.")


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
