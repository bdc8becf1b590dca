"""One reducer per node: it calls its node's gradient workers and adds their clipped sums on the node.

The driver then receives one float64 buffer per node, not one float32
buffer per worker, and sends one call per node. The weights reach the node's
object store once and every worker there reads them from it. Clipped sums
never leave the node of the workers that computed them except as this sum,
and it goes only to the driver, where the noise is added.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import ray


def add_into(total: np.ndarray | None, part: np.ndarray) -> np.ndarray:
    """`total` + `part` in float64, in place when `total` is given (the first part is copied up to float64)."""
    if total is None:
        return np.asarray(part, dtype=np.float64).copy()
    total += part
    return total


class NodeReducer:
    """Holds the gradient worker actors of one node and returns the float64 sum of what they compute."""

    def __init__(self) -> None:
        self.workers: dict[Hashable, Any] = {}

    def set_workers(self, workers: Mapping[Hashable, Any]) -> None:
        """The node's worker actors by the driver's name for each (a worker index, or a shard slot)."""
        self.workers = dict(workers)

    def reduce(
        self, method: str, weights: Sequence[ray.ObjectRef], calls: Mapping[Hashable, tuple],
        options: Mapping[str, Any],
    ) -> tuple[np.ndarray, float]:
        """Call ``method(weights, *calls[name], **options)`` on each named worker; their sum, and the slowest time.

        ``weights`` is a one-element list holding the weights' object
        reference, so that it is passed on as a reference and each worker
        reads the node's copy. Parts are added as they arrive, in float64.
        The time is the slowest worker's seconds inside its call. A worker's
        error (a lost actor) is raised to the driver, which recomputes that
        node's parts by itself.
        """
        pending = [self.workers[name].timed_call.remote(method, weights[0], *arguments, **options)
                   for name, arguments in calls.items()]
        total, slowest = None, 0.0
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            part, seconds = ray.get(ready[0])
            total = add_into(total, part)
            slowest = max(slowest, seconds)
        return total, slowest


NodeReducerActor = ray.remote(NodeReducer)
