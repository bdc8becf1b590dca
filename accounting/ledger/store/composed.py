"""The `composed_pld` table: each budget's composed PLD as last kept, so a restart extends it rather than replay;
and the background composition that extends a dataset's PLD shortly after its commits.

A row is a cache of a report, never read by admission: `ComposedPld`
carries an HMAC under the history key, and a row that does not match it
is ignored (the distribution is composed again from the committed events).
With the distribution it keeps the exact RDP tally of the same events: a
restart reads the two back and computes only the steps committed since, no
mechanism's RDP curve or one-step PLD for the rest.
A state is written at most every KEEP_EVERY_SECONDS per budget while the
ledger is open, and once more when it closes, so a restart composes at most
that much of the latest commits again.

A commit does not compose: it hands its dataset to `BackgroundComposition`,
whose thread, SETTLE_SECONDS later, does what a status of the dataset does
(each budget's distribution extended by the steps committed since, in one
composition per mechanism that gained steps). A burst of commits costs one
composition, a commit's own time does not grow with the mechanisms, and a
status or a restart finds the distribution composed: a ledger that closes
composes the commits its thread has not reached before it keeps the states.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Callable, Hashable, Iterable

from accounting.events import Composition
from accounting.ledger.admission import RdpTally, remember_stored_tally, remembered_tally, stored_tally
from accounting.ledger.composed import COMPOSED, ComposedPld, new_steps
from accounting.ledger.databases import Connection
from accounting.ledger.store.datasets import DatasetRow
from accounting.ledger.store.clock import now

KEEP_EVERY_SECONDS = 10.0
# How long after a commit its dataset's distribution is composed: the commits of a burst are composed at once.
SETTLE_SECONDS = 1.0

_LOG = logging.getLogger(__name__)


class ComposedDistributions:
    """The rows of `composed_pld` of the ledger at `location`, under the history `key`, and which of the
    states composed in memory (composed.COMPOSED) are due to be kept there."""

    def __init__(self, location: str, key: bytes | None) -> None:
        self._location = location
        self._key = key
        # Per budget: the events of the state last written, and when (time.monotonic).
        self._written: dict[int, tuple[object, float]] = {}
        self._asked: set[int] = set()  # the budgets whose states were looked at: those a close keeps
        self._lock = threading.Lock()

    def lineage(self, budget_id: int) -> Hashable:
        """The name of a budget's composed state in memory."""
        return ("ledger", self._location, budget_id)

    def recall(self, connection: Connection, budgets: Iterable[DatasetRow]) -> None:
        """Put in memory, after a restart, what was kept of each budget that memory lacks: its composed state,
        and the RDP tally of its committed steps (the kept state's tally plus that of the steps committed
        since, the only curves computed), so that a status computes neither again."""
        if self._key is None:
            return
        for budget in budgets:
            lineage = self.lineage(budget.dataset_id)
            if COMPOSED.get(lineage) is not None and remembered_tally(budget.committed_events) is not None:
                continue
            row = connection.execute(
                "SELECT state FROM composed_pld WHERE budget_id = ?", (budget.dataset_id,)
            ).fetchone()
            state = ComposedPld.from_bytes(bytes(row[0]), self._key) if row is not None else None
            if state is None:
                continue
            if COMPOSED.get(lineage) is None:
                COMPOSED.keep(lineage, state)
                with self._lock:
                    self._written.setdefault(budget.dataset_id, (state.events, time.monotonic()))
            since = new_steps(state.events, Composition.from_json(budget.committed_events))
            if state.rdp_tally and since is not None and remembered_tally(budget.committed_events) is None:
                remember_stored_tally(budget.committed_events, RdpTally.from_json(state.rdp_tally) + RdpTally.of(since))

    def due(
        self, budget_ids: Iterable[int] | None = None, every: float = KEEP_EVERY_SECONDS
    ) -> list[tuple[int, ComposedPld]]:
        """The budgets (default every one looked at) whose state in memory is newer than the one kept, last kept
        over `every` seconds ago."""
        if self._key is None:
            return []
        due = []
        with self._lock:
            if budget_ids is None:
                budget_ids = sorted(self._asked)
            for budget_id in budget_ids:
                self._asked.add(budget_id)
                state = COMPOSED.get(self.lineage(budget_id))
                written = self._written.get(budget_id)
                if state is None or not state.events.events:
                    continue
                if written is None or (
                    written[0] != state.events and time.monotonic() - written[1] >= every
                ):
                    due.append((budget_id, state))
        # Each kept with the tally of its events (remembered by the status that composed them: no curve computed).
        return [(budget_id, replace(state, rdp_tally=stored_tally(state.events.to_json()).to_json()))
                for budget_id, state in due]

    def keep(self, connection: Connection, budget_id: int, state: ComposedPld) -> None:
        """Keep `state` as the budget's, in place of the one kept before."""
        connection.execute(
            "INSERT INTO composed_pld (budget_id, state, at) VALUES (?, ?, ?) "
            "ON CONFLICT (budget_id) DO UPDATE SET state = excluded.state, at = excluded.at",
            (budget_id, state.to_bytes(self._key), now()),
        )
        with self._lock:
            self._written[budget_id] = (state.events, time.monotonic())


class BackgroundComposition:
    """A thread that, SETTLE_SECONDS after a commit, calls `compose` with the ids of the datasets committed to
    since its last call (what a status of them does: see the module's doc); started by the first commit."""

    def __init__(self, compose: Callable[[set[int]], None]) -> None:
        self._compose = compose
        self._pending: set[int] = set()
        self._condition = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def committed(self, dataset_id: int) -> None:
        """Compose `dataset_id`'s distribution soon (with the others committed to meanwhile)."""
        with self._condition:
            if self._closed:
                return
            self._pending.add(dataset_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dpfleet-composition", daemon=True)
                self._thread.start()
            self._condition.notify_all()

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._pending or self._closed)
                self._condition.wait_for(lambda: self._closed, timeout=SETTLE_SECONDS)
                if self._closed:
                    return
                pending, self._pending = self._pending, set()
            self._compose_logged(pending)

    def _compose_logged(self, pending: set[int]) -> None:
        try:
            self._compose(pending)
        except Exception:  # a cache of a report: the next status composes what this one did not
            _LOG.warning("composing the PLD of datasets %s in the background failed", sorted(pending),
                         exc_info=True)

    def close(self) -> None:
        """Stop: a composition under way finishes first, then the datasets committed to since are composed
        here, so that the states kept at close hold every commit and a restart composes nothing again."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._condition:
            pending, self._pending = self._pending, set()
        if pending:
            self._compose_logged(pending)
