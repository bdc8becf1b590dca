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
