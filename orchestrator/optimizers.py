"""Torch optimizers as post-processing of the noisy mean gradient."""

from __future__ import annotations

from typing import Iterable

import torch

from orchestrator.config import OptimizerConfig


def build_optimizer(
    optimizer: OptimizerConfig, learning_rate: float, parameters: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The torch optimizer named in the config (sgd, momentum, adam, adamw) with its parameters."""
    options = dict(optimizer.parameters)
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    if optimizer.name in ("sgd", "momentum"):
        return torch.optim.SGD(parameters, lr=learning_rate, **options)
    if optimizer.name == "adam":
        return torch.optim.Adam(parameters, lr=learning_rate, **options)
    return torch.optim.AdamW(parameters, lr=learning_rate, **options)
