"""The driver's windows of planned batches: the next K steps' samples gathered ahead by Ray Data on its node.

The samples come from `step_sample` under the run key, as they do step by
step, so a planned run trains on exactly the batches an unplanned one would.
The windows themselves (`workers.planned_batches.PlannedWindows`) gather
window k + 1 while window k trains and delete each folder once its steps ran;
their files are sealed under a key in the driver's memory and padded to the
largest share's expected size plus a margin (`expected_share`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import ray

from workers.planned_batches import PlannedDataset, PlannedWindows, auto_window_steps


def window_steps(plan_ahead_steps: int | str, dataset: PlannedDataset, expected_batch_size: float,
                 total_steps: int) -> int:
    """The window's length: `plan_ahead_steps`, or for "auto" about 256 MiB of rows (`auto_window_steps`)."""
    if plan_ahead_steps != "auto":
        return int(plan_ahead_steps)
    return auto_window_steps(expected_batch_size, dataset.row_bytes, total_steps)


def expected_share(expected_batch_size: float, workers: int, microbatches: int | None) -> float:
    """The expected rows of the largest worker's share of a step (public: it sizes every window file).

    The shares are near-equal parts of the sample, or with microbatches
    whole microbatches, G of them dealt round the workers, so that one
    worker holds ceil(G / workers) of them.
    """
    if microbatches is None:
        return expected_batch_size / workers
    return expected_batch_size * -(-microbatches // workers) / microbatches


def driver_windows(plan_ahead_steps: int | str, dataset: PlannedDataset, expected_batch_size: float,
                   total_steps: int, first_step: int, shares_of: Callable[[int], list[np.ndarray]], workers: int,
                   microbatches: int | None) -> PlannedWindows:
    """The run's planned windows from `first_step` on, gathered on the driver's node (where the workers read them).

    `shares_of(step)` is the step's sample split across the `workers`
    workers, as the step will send it, in `microbatches` when not None.
    """
    return PlannedWindows(dataset, window_steps(plan_ahead_steps, dataset, expected_batch_size, total_steps),
                          total_steps, shares_of, expected_share(expected_batch_size, workers, microbatches),
                          first_step, ray.get_runtime_context().get_node_id())
