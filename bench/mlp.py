"""Multilayer perceptrons on MNIST of set sizes, for the scaling benchmarks and the collective path's tests.

Name one in a config as ``model = "bench.mlp:mlp_1m"``. Each is Flatten, then
Linear-Tanh layers of one width, then a Linear to the 10 classes; the width
and depth set the parameter count.
"""

from __future__ import annotations

from torch import nn

INPUTS, CLASSES = 28 * 28, 10


def mlp(width: int, hidden_layers: int = 1) -> nn.Sequential:
    """An MLP with `hidden_layers` Tanh layers of `width` units between MNIST's 784 inputs and its 10 classes."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(INPUTS, width), nn.Tanh()]
    for _ in range(hidden_layers - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, CLASSES))


def mlp_tiny() -> nn.Sequential:
    """6,370 parameters: the tests' model."""
    return mlp(8)


def mlp_small() -> nn.Sequential:
    """50,890 parameters: eight times the tiny one, for tests that compare sizes."""
    return mlp(64)


def mlp_1m() -> nn.Sequential:
    """1.01M parameters."""
    return mlp(1270)


def mlp_10m() -> nn.Sequential:
    """10.0M parameters."""
    return mlp(2800, hidden_layers=2)


def mlp_40m() -> nn.Sequential:
    """40.8M parameters."""
    return mlp(6000, hidden_layers=2)


def mlp_100m() -> nn.Sequential:
    """99.8M parameters."""
    return mlp(9600, hidden_layers=2)
