"""The torch optimizers that step on the noisy mean gradient, built by name for the driver or a collective rank."""

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
