"""Early stopping: whether a run stops at an evaluation point, from its released test metrics alone.

The rule reads the metrics rows the run already released (each row a
function of the noisy weights and the test split), so the decision is
post-processing as long as the test split is not private training data;
the steps it leaves unrun are never charged (the trainer releases them).
"""

from __future__ import annotations

from collections.abc import Sequence

# Metrics where a smaller value is better; every other metric (accuracy, AUROC) is better larger.
SMALLER_IS_BETTER = ("loss", "mse", "mae")


def evaluations_without_improvement(rows: Sequence[dict], metric: str, min_delta: float) -> int:
    """How many of the last evaluations in ``rows`` (metrics rows, oldest first) came after the best one.

    An evaluation improves on the best so far when it beats it by more
    than ``min_delta`` (lower for SMALLER_IS_BETTER metrics, else higher).
    """
    sign = -1.0 if metric in SMALLER_IS_BETTER else 1.0
    best, since_best = None, 0
    for row in rows:
        value = sign * row[f"test_{metric}"]
        if best is None or value > best + min_delta:
            best, since_best = value, 0
        else:
            since_best += 1
    return since_best


def stops_early(rows: Sequence[dict], metric: str, patience: int, min_delta: float) -> bool:
    """Whether the run stops now: its last ``patience`` evaluations of ``metric`` did not improve on the best."""
    return evaluations_without_improvement(rows, metric, min_delta) >= patience
