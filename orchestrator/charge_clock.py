"""When a run's ledger charges are sent: on a clock fixed before the first step, never when the steps reach a block.

``charge_offsets`` is the schedule, a function of the plan and a pace
alone; ``ChargeClock`` keeps it from a background thread, and the trainer
starts it at its first step and waits on it before each block.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from accounting.events import Composition

# The clock gives a step, and each pause, this many times what it took as the run started on made-up examples
# (orchestrator.fleet.made_up_step_seconds, Trainer._pauses): room for the driver's optimizer step and bookkeeping.
PACE_MARGIN = 1.4


class ChargedBlocks(Protocol):
    """What the charge clock needs from a ledger session: commit block `sequence`, idempotently."""

    def charge(self, sequence: int, events: Composition) -> None:
        """Commit `events` (block number `sequence`) durably; a repeat of the same block charges nothing more."""


class LedgerSession(ChargedBlocks, Protocol):
    """What the trainer needs from the privacy ledger: its reservation, and blocks charged before they run."""

    reservation_id: str


def block_at(charge_ends: Sequence[int], step: int) -> int:
    """The index of the ledger block that holds step `step` (0-based); `charge_ends` are the blocks' end steps."""
    return next(index for index, end in enumerate(charge_ends) if end > step)


def blocks_covered(charge_ends: Sequence[int], committed_steps: int) -> int:
    """How many blocks the ledger's `committed_steps` of a run are (its commits charge whole blocks, in order);
    ValueError when they end inside a block, as no run of this plan commits."""
    covered = sum(1 for end in charge_ends if end <= committed_steps)
    if committed_steps != (charge_ends[covered - 1] if covered else 0):
        raise ValueError(f"{committed_steps} committed steps end inside a block of the plan (blocks end at steps "
                         f"{', '.join(map(str, charge_ends))})")
    return covered


def charge_offsets(charge_ends: Sequence[int], first_block: int, first_step: int, seconds_per_step: float,
                   pauses: Mapping[int, float] | None = None) -> list[float]:
    """Seconds after the clock starts at which each block from `first_block` on is charged (`charge_ends` are the
    blocks' end steps): when steps of `seconds_per_step` each, from step `first_step` (where this start of the run
    begins), would reach the block's first step; the block that holds `first_step` at once. `pauses` maps a step
    count to the seconds the run spends after that many steps outside them (an evaluation, the progress line's ε):
    those after `first_step` and up to the block's first step are added to its offset.

    A function of the plan, the pace and the pauses alone, all fixed before
    the first step: the steps' own times never enter it.
    """
    if seconds_per_step <= 0:
        raise ValueError(f"seconds_per_step must be > 0 (got {seconds_per_step})")
    pause_steps = sorted(step for step in (pauses or {}) if step > first_step)
    paused = list(itertools.accumulate((pauses[step] for step in pause_steps), initial=0.0))
    starts = [0, *charge_ends[:-1]]
    return [seconds_per_step * max(0, starts[block] - first_step)
            + paused[bisect.bisect_right(pause_steps, starts[block])] for block in range(first_block, len(charge_ends))]


def progress_refresh_steps(epoch_ends: Sequence[int], first_step: int) -> list[int]:
    """The step counts after which a run that starts at step `first_step` redraws its progress line's ε: each
    epoch's steps from there are split in four (at least a step each), as ``Trainer._train_epoch`` counts them."""
    refreshes, start = [], first_step
    for end in epoch_ends:
        if end <= first_step:
            continue
        every = max(1, (end - start) // 4)
        refreshes.extend(range(start + every, end + 1, every))
        start = end
    return refreshes


def clock_pace(commit_interval: float | None, block_steps: int, measured_step_seconds: float | None) -> float:
    """The charge clock's pace, in seconds per step: `commit_interval` (seconds a block) over a block's
    `block_steps` where the config sets it, else PACE_MARGIN times the step's round trip measured on made-up
    examples (``fleet.made_up_step_seconds``)."""
    if commit_interval is not None:
        return commit_interval / block_steps
    if measured_step_seconds is None:
        raise ValueError("a pace needs commit_interval or a measured step time")
    return PACE_MARGIN * measured_step_seconds


def uncharged_blocks(plan, charged: int) -> list[tuple[int, Composition]]:
    """(sequence, row-level events) of each block of `plan` (a RunPlan) from block `charged` on, in order."""
    ends = plan.charge_ends
    return [(index, plan.row_level_events_between(ends[index - 1] if index else 0, end))
            for index, end in enumerate(ends) if index >= charged]


class ChargeClock:
    """Charges a run's blocks on a fixed clock from a background thread: block `blocks[k]` at `offsets[k]` seconds
    after `start` (``charge_offsets``).

    Commit times reach whoever operates the ledger, in its chained history and
    as the calls arrive. Charged when the steps reach a block, the gaps
    between commits would be the blocks' wall times, which grow with the
    realised batch sizes; sent on a clock at fixed intervals, how many blocks
    each tick carried would still track the steps' progress, and times rounded
    to a coarse grain would keep both. So the schedule is fixed before the
    first step, from the plan and a pace alone: the clock never looks at the
    steps, and the steps wait for their block's charge (`wait_for`). Steps
    faster than the clock wait for it; slower ones leave blocks charged ahead
    of them, which is safe (a block is never run uncharged) and costs nothing
    on a resume, since a block's sequence charges once.
    """

    def __init__(self, ledger: ChargedBlocks, blocks: Sequence[tuple[int, Composition]], offsets: Sequence[float]):
        if len(offsets) != len(blocks) or any(later < earlier for earlier, later in zip(offsets, offsets[1:])):
            raise ValueError(f"offsets must be one per block, in order (got {list(offsets)} for {len(blocks)} blocks)")
        self.ledger, self.blocks, self.offsets = ledger, list(blocks), list(offsets)
        self._charged: set[int] = set()
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._charge_on_the_clock, name="charge-clock", daemon=True)

    def start(self) -> "ChargeClock":
        """Start the clock now (the run's first step): blocks at offset 0 are charged at once. A clock already
        started carries on as it was."""
        if self._thread.ident is None:
            self._thread.start()
        return self

    def _charge_on_the_clock(self) -> None:
        started = time.monotonic()
        for offset, (sequence, events) in zip(self.offsets, self.blocks):
            if self._stopping.wait(max(0.0, started + offset - time.monotonic())):
                return
            try:
                self.ledger.charge(sequence, events)
            except BaseException as error:  # noqa: BLE001 - handed to the steps waiting for this block
                with self._changed:
                    self._error = error
                    self._changed.notify_all()
                return
            with self._changed:
                self._charged.add(sequence)
                self._changed.notify_all()

    def wait_for(self, sequence: int) -> None:
        """Return once block `sequence` is charged; raise what stopped the clock if it never will be."""
        if sequence not in {planned for planned, _ in self.blocks}:
            raise ValueError(f"block {sequence} is not on this clock (blocks {[s for s, _ in self.blocks]})")
        with self._changed:
            while sequence not in self._charged:
                if self._error is not None:
                    raise self._error
                if not self._thread.is_alive() and self._stopping.is_set():
                    raise RuntimeError(f"the charge clock was stopped before block {sequence} was charged")
                self._changed.wait(0.5)

    def stop(self) -> None:
        """Charge no more blocks, and return once the clock's thread has ended: a charge under way (retrying
        through an outage, perhaps) finishes first. The process may end next, and a thread still inside the
        ledger's arithmetic as Python shuts down can abort it."""
        self._stopping.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()
