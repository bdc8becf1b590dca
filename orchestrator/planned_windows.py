"""The driver's windows of planned batches: the next K steps' samples gathered ahead by Ray Data.

The samples come from `step_sample` under the run key, as they do step by
step, so a planned run trains on exactly the batches an unplanned one would.
At most two windows exist at a time (the step's and, for the read-ahead of
the next step, the following one); each window's folder is deleted as soon
as its last step has run, and every folder when the run ends. Only step
numbers are kept here besides the folders' names: the shares themselves are
dropped once gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from workers.planned_batches import PlannedBatch, gather_window, private_window_folder, remove_window_folder


class PlannedWindows:
    """Windows of `window_steps` steps of `spec`'s Parquet training rows, gathered before their steps run.

    `shares_of(step)` is the step's sample split across the workers, as the
    step will send it. The gather runs on the driver's node, where the
    folders are: the workers read them there.
    """

    def __init__(self, spec: Mapping, window_steps: int, total_steps: int,
                 shares_of: Callable[[int], list[np.ndarray]]) -> None:
        if window_steps < 1:
            raise ValueError(f"plan_ahead_steps must be >= 1 (got {window_steps})")
        self.spec, self.window_steps, self.total_steps, self.shares_of = spec, window_steps, total_steps, shares_of
        self.folders: dict[int, str] = {}

    def batch(self, step: int, worker: int) -> PlannedBatch | None:
        """Where worker `worker` finds its share of `step`, its window gathered first (None past the last step)."""
        if step >= self.total_steps:
            return None
        window = step // self.window_steps
        if window not in self.folders:
            self._gather(window)
        return PlannedBatch(self.folders[window], step, worker)

    def done_with(self, step: int) -> None:
        """Delete the folders of the windows whose every step is before `step` + 1 (they ran)."""
        for window in [window for window in self.folders if (window + 1) * self.window_steps <= step + 1]:
            remove_window_folder(self.folders.pop(window))

    def close(self) -> None:
        """Delete every window's folder (at the end of the run, or when it stops)."""
        for folder in self.folders.values():
            remove_window_folder(folder)
        self.folders.clear()

    def _gather(self, window: int) -> None:
        start = window * self.window_steps
        steps = range(start, min(start + self.window_steps, self.total_steps))
        folder = private_window_folder()
        self.folders[window] = folder
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # Which row groups were read says which held a sampled row: it is dropped, never kept or logged.
        gather_window(self.spec, {step: self.shares_of(step) for step in steps}, folder, {"scheduling_strategy": here})
