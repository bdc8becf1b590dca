"""The torch optimizers that step on the noisy mean gradient, built by name for the driver or a collective rank,
and the moving average of the weights they step."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

# Each of these updates every coordinate from that coordinate's gradient and state alone, so a rank that holds a
# slice of the coordinates and their state steps them exactly as the whole-vector optimizer would (ZeRO-1).
OPTIMIZER_NAMES = ("sgd", "momentum", "adam", "adamw")


def torch_optimizer(
    name: str, learning_rate: float, parameters: Iterable[torch.nn.Parameter], options: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """The torch optimizer `name` (one of OPTIMIZER_NAMES) over `parameters`, with its `options` (e.g. betas)."""
    options = dict(options)
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    if name in ("sgd", "momentum"):
        return torch.optim.SGD(parameters, lr=learning_rate, **options)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=learning_rate, **options)
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=learning_rate, **options)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_NAMES)} (got {name!r})")


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
