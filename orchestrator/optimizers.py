"""Torch optimizers as post-processing of the noisy mean gradient."""

from __future__ import annotations

from typing import Iterable

import torch

from orchestrator.config import OptimizerConfig
from orchestrator.schedules import LearningRateSchedule
from workers.optimizers import torch_optimizer


def build_optimizer(
    optimizer: OptimizerConfig, learning_rate: float, parameters: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The torch optimizer named in the config (sgd, momentum, adam, adamw) with its parameters."""
    return torch_optimizer(optimizer.name, learning_rate, parameters, optimizer.parameters)


def build_lr_scheduler(
    schedule: LearningRateSchedule, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A torch scheduler stepped once per DP step, or None for a constant rate."""
    if schedule.kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps))
    if schedule.kind == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=schedule.step_size, gamma=schedule.gamma)
    if schedule.kind == "exponential":
        return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=schedule.gamma)
    return None


EMA_WARMUP = 10.0


def ema_decay_at(decay: float, step: int) -> float:
    """The decay of the weights' moving average at update ``step`` (0-based): min(decay, (1 + t) / (10 + t)).

    The warm-up (TensorFlow's ExponentialMovingAverage with num_updates)
    keeps the first updates from being dominated by the initial weights.
    """
    return min(decay, (1.0 + step) / (EMA_WARMUP + step))


def update_ema(average: torch.Tensor, weights: torch.Tensor, decay: float, step: int) -> None:
    """Move ``average`` toward ``weights`` in place: average = d * average + (1 - d) * weights, d = ema_decay_at."""
    rate = ema_decay_at(decay, step)
    average.mul_(rate).add_(weights, alpha=1.0 - rate)
