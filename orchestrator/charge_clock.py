"""When a run's ledger charges are sent: on a fixed clock, never when the steps reach a block.

See ``ChargeClock``; the trainer starts one per run and waits on it before each block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

from accounting.events import Composition


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


def uncharged_blocks(plan, charged: int) -> list[tuple[int, Composition]]:
    """(sequence, row-level events) of each block of `plan` (a RunPlan) from block `charged` on, in order."""
    ends = plan.charge_ends
    return [(index, plan.row_level_events_between(ends[index - 1] if index else 0, end))
            for index, end in enumerate(ends) if index >= charged]


class ChargeClock:
    """Charges a run's blocks on a fixed clock from a background thread: block i of `blocks` at start + i * interval.

    Commit times reach whoever operates the ledger, in its chained history and
    as the calls arrive. Charged when the steps reach a block, the gaps
    between commits would be the blocks' wall times, which grow with the
    realised batch sizes; sent on a clock at fixed intervals, how many blocks
    each tick carried would still track the steps' progress, and times rounded
    to a coarse grain would keep both. So the schedule is fixed before the
    first step, from the plan alone: the clock never looks at the steps, and
    the steps wait for their block's charge (`wait_for`). A clock faster than
    the steps charges blocks ahead of them, which is safe (a block is never
    run uncharged) and costs nothing on a resume, since a block's sequence
    charges once; a slower one makes the steps wait.
    """

    def __init__(self, ledger: ChargedBlocks, blocks: Sequence[tuple[int, Composition]], interval_seconds: float):
        if interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be > 0 (got {interval_seconds})")
        self.ledger, self.blocks, self.interval_seconds = ledger, list(blocks), interval_seconds
        self._charged: set[int] = set()
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._charge_on_the_clock, name="charge-clock", daemon=True)

    def start(self) -> "ChargeClock":
        """Start the clock now: the first block is charged at once."""
        self._thread.start()
        return self

    def _charge_on_the_clock(self) -> None:
        started = time.monotonic()
        for tick, (sequence, events) in enumerate(self.blocks):
            if self._stopping.wait(max(0.0, started + tick * self.interval_seconds - time.monotonic())):
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
        """Charge no more blocks; a charge under way (retrying through an outage, perhaps) may still finish."""
        self._stopping.set()
