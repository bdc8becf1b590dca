"""What a run has done, besides its weights: the part of a checkpoint that the training loop advances."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from accounting.events import Composition

# The breakdown of a step's wall time, per step, averaged over every step of the run's last start in the summary:
# a step's own time tracks its realised batch size, so timings go into no metrics row and no checkpoint.
BREAKDOWN = ("driver_seconds_per_step", "worker_seconds_per_step", "wait_seconds_per_step")


@dataclass(frozen=True)
class StepTimes:
    """Seconds over a number of steps: the driver's own, the slowest worker's in its call, the driver's wait.

    The driver's own time is a step's wall time minus its wait for the
    workers' sums: what the workers wait for between steps. `driver_bytes`
    counts the bytes the driver sent and received for the steps (see
    `Trainer._step`), a measure of whether it is on the data path; it counts
    the sample's indices, so it is run-private (orchestrator/release.py):
    benchmarks read it from memory, and no output holds it.
    """

    steps: int = 0
    driver: float = 0.0
    worker: float = 0.0
    wait: float = 0.0
    driver_bytes: float = 0.0

    def plus(self, wall: float, worker: float, wait: float, driver_bytes: float = 0.0) -> StepTimes:
        """These times and one more step's."""
        return StepTimes(self.steps + 1, self.driver + wall - wait, self.worker + worker, self.wait + wait,
                         self.driver_bytes + driver_bytes)

    def minus(self, earlier: StepTimes) -> StepTimes:
        """The steps since `earlier`, a copy of these times taken then."""
        return StepTimes(self.steps - earlier.steps, self.driver - earlier.driver, self.worker - earlier.worker,
                         self.wait - earlier.wait, self.driver_bytes - earlier.driver_bytes)

    def driver_bytes_per_step(self) -> float:
        """The mean bytes the driver moved in a step (run-private: for benchmarks and tests, from memory)."""
        return self.driver_bytes / self.steps

    def per_step(self) -> dict[str, float]:
        """The BREAKDOWN means, in seconds per step (empty with no steps)."""
        if not self.steps:
            return {}
        return dict(zip(BREAKDOWN, (self.driver / self.steps, self.worker / self.steps, self.wait / self.steps)))


@dataclass
class RunRecord:
    """What a run has done, besides its weights: what a checkpoint carries of it, with the run's wall clock.

    What a checkpoint carries is neither secret nor raw: the events, the
    metrics rows (noisy), the number of ledger blocks charged, the (noisily
    adapted) clip norm and the shards' outages. The timings and the wall
    clock stay in memory: two checkpoints' timings would give the time of the
    steps between them, which tracks their batch sizes, so a resumed run's
    clock and timings start again. A new run's id names its checkpoints; a
    resume takes the id of the run it continues.
    """

    clip_norm: float
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))
    events: Composition = field(default_factory=Composition)
    # Steps run: the events' steps are participations under a correlated mechanism, not training steps.
    steps_run: int = 0
    metrics: list[dict] = field(default_factory=list)
    charged_blocks: int = 0
    shard_outages: list[dict] = field(default_factory=list)
    times: StepTimes = field(default_factory=StepTimes)
    # perf_counter() when the clock last started: the record's creation, or the start of training.
    clock_started: float = field(default_factory=time.perf_counter)

    @property
    def step(self) -> int:
        """Steps run so far."""
        return self.steps_run

    def account_step(self, events: Composition) -> None:
        """One more step has run, with these events."""
        self.events = self.events.then(events)
        self.steps_run += 1

    def wall_seconds(self) -> float:
        """Seconds this start of the run has trained."""
        return time.perf_counter() - self.clock_started

    def restart_clock(self) -> None:
        """Count from now (training starts): the time since the last count is not the run's."""
        self.clock_started = time.perf_counter()

    def to_state(self) -> dict[str, Any]:
        """The record as a checkpoint's keys."""
        return {
            "run_id": self.run_id,
            "step": self.step,
            "events": self.events.to_dict(),
            "metrics": self.metrics,
            "charged_blocks": self.charged_blocks,
            "clip_norm": self.clip_norm,
            "shard_outages": self.shard_outages,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RunRecord:
        """The record a checkpoint's state carries (see `to_state`); its clock and timings start now."""
        return cls(clip_norm=state["clip_norm"], run_id=state["run_id"], events=Composition.from_dict(state["events"]),
                   steps_run=state["step"],
                   metrics=list(state["metrics"]), charged_blocks=state["charged_blocks"],
                   shard_outages=list(state.get("shard_outages", [])))
