"""Hyperparameter search as data: the trials a grid or a random search runs, and what selecting among them costs.

Every trial is an ordinary dpfleet job, charged to the ledger like any
other. Choosing the best trial looks at every trial's model, so the model
it picks is accounted as the composition of all the trials' events: its ε
is that of running them all (the simplest rigorous option; private
selection in the manner of Papernot & Steinke 2022 would cost less, and is
not what this does).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from accounting.events import Composition
from orchestrator.checks import unknown_names
from orchestrator.config import KEYS
from orchestrator.errors import UsageError

# Metrics where lower is better; for every other metric the best trial is the one with the highest value.
LOWER_IS_BETTER = ("mse", "mae", "loss")


def parse_grid(grid: Mapping[str, Any]) -> dict[str, list]:
    """Validate a search space: config keys, each with a non-empty list of values to try."""
    if not grid:
        raise UsageError("the grid is empty; give config keys with lists of values, e.g. learning_rate = [1.0, 2.0]")
    unknown = sorted(set(grid) - KEYS)
    if unknown:
        raise UsageError(f"the grid names unknown config key(s): {unknown_names(unknown, KEYS)}")
    for name, values in grid.items():
        if not (isinstance(values, list) and values):
            raise UsageError(f"grid key {name} must be a non-empty list of values (got {values!r})")
        if name in ("run_dir", "seed"):
            raise UsageError(f"grid key {name} is set per trial by dpfleet tune; leave it out of the grid")
    return {name: list(values) for name, values in grid.items()}


def grid_trials(grid: Mapping[str, list]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, the last key varying fastest."""
    names = list(grid)
    return [dict(zip(names, values)) for values in itertools.product(*(grid[name] for name in names))]


def random_trials(grid: Mapping[str, list], trials: int, generator: np.random.Generator) -> list[dict[str, Any]]:
    """``trials`` distinct combinations of the grid drawn uniformly at random (all of them if there are fewer)."""
    every = grid_trials(grid)
    if trials < 1:
        raise UsageError(f"trials must be >= 1 (got {trials})")
    chosen = generator.choice(len(every), size=min(trials, len(every)), replace=False)
    return [every[index] for index in sorted(chosen)]


def best_trial(results: Sequence[Mapping[str, Any]], metric: str) -> int:
    """The index of the result with the best ``test_<metric>`` (highest, or lowest for an error metric)."""
    values = [result[f"test_{metric}"] for result in results]
    pick = min if metric in LOWER_IS_BETTER else max
    return values.index(pick(values))


def selection_events(trial_events: Sequence[Composition]) -> Composition:
    """What the selected trial is accounted as: every trial's events, one after another."""
    combined = Composition()
    for events in trial_events:
        combined = combined.then(events)
    return combined
