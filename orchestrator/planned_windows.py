"""The driver's windows of planned batches: the next K steps' samples gathered ahead by Ray Data on its node.

The samples come from `step_sample` under the run key, as they do step by
step, so a planned run trains on exactly the batches an unplanned one would.
The windows themselves (`workers.planned_batches.PlannedWindows`) gather
window k + 1 while window k trains and delete each folder once its steps ran;
their files are sealed under a key in the driver's memory and padded to the
largest share's expected size plus a margin (`expected_share`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import numpy as np
import ray

from orchestrator.config import TrainConfig, planned_batch_steps, planned_batches_refusals
from workers.planned_batches import PlannedDataset, PlannedWindows, auto_window_steps


def ray_of_one_node() -> bool:
    """Whether the run's Ray is one node: the local Ray the run starts (RAY_ADDRESS unset), or one up with one node."""
    if ray.is_initialized():
        return sum(bool(node["Alive"]) for node in ray.nodes()) == 1
    return not os.environ.get("RAY_ADDRESS")


def run_planned_batches(config: TrainConfig, one_node: bool) -> tuple[int | str | None, str | None]:
    """The run's planned batches (`planned_batch_steps`, or None) and why its Parquet table is read row by row.

    The reason is None unless the run reads a Parquet table one row at a
    time; it names config keys only. Without the key, the driver path plans
    only on a Ray of one node (`one_node`): its windows are written on the
    driver's node, which a cluster's workers may not share. Silos gather
    their own windows on their own nodes.
    """
    steps = planned_batch_steps(config)
    if config.shards:
        return steps, None
    if steps is not None:
        if config.plan_ahead_steps is None and not one_node:
            return None, ("on a Ray cluster planned batches are gathered on the driver's node, which the workers "
                          'may not share; set plan_ahead_steps = "auto" where they share its TMPDIR')
        return steps, None
    if not (isinstance(config.dataset, Mapping) and config.dataset.get("format") == "parquet"):
        return None, None
    refusals = planned_batches_refusals(config)
    return None, (f"{', '.join(refusals)} cannot use planned batches" if refusals else 'plan_ahead_steps = "off"')


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
