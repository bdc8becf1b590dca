"""The `composed_pld` table: each budget's composed PLD as last kept, so a restart extends it rather than replay.

A row is a cache of a report, never read by admission: `ComposedPld`
carries an HMAC under the history key, and a row that does not match it
is ignored (the distribution is composed again from the committed events).
A state is written at most every KEEP_EVERY_SECONDS per budget, so a
restart composes at most that much of the latest commits again.
"""

from __future__ import annotations

import threading
import time
from typing import Hashable, Iterable

from accounting.ledger.composed import COMPOSED, ComposedPld
from accounting.ledger.databases import Connection
from accounting.ledger.store.clock import now

KEEP_EVERY_SECONDS = 10.0


class ComposedDistributions:
    """The rows of `composed_pld` of the ledger at `location`, under the history `key`, and which of the
    states composed in memory (composed.COMPOSED) are due to be kept there."""

    def __init__(self, location: str, key: bytes | None) -> None:
        self._location = location
        self._key = key
        # Per budget: the events of the state last written, and when (time.monotonic).
        self._written: dict[int, tuple[object, float]] = {}
        self._lock = threading.Lock()

    def lineage(self, budget_id: int) -> Hashable:
        """The name of a budget's composed state in memory."""
        return ("ledger", self._location, budget_id)

    def recall(self, connection: Connection, budget_ids: Iterable[int]) -> None:
        """Put in memory the kept state of each budget that has none there (after a restart)."""
        if self._key is None:
            return
        for budget_id in budget_ids:
            if COMPOSED.get(self.lineage(budget_id)) is not None:
                continue
            row = connection.execute("SELECT state FROM composed_pld WHERE budget_id = ?", (budget_id,)).fetchone()
            state = ComposedPld.from_bytes(bytes(row[0]), self._key) if row is not None else None
            if state is not None:
                COMPOSED.keep(self.lineage(budget_id), state)
                with self._lock:
                    self._written.setdefault(budget_id, (state.events, time.monotonic()))

    def due(self, budget_ids: Iterable[int]) -> list[tuple[int, ComposedPld]]:
        """The budgets whose state in memory is newer than the one kept, last kept over KEEP_EVERY_SECONDS ago."""
        if self._key is None:
            return []
        due = []
        with self._lock:
            for budget_id in budget_ids:
                state = COMPOSED.get(self.lineage(budget_id))
                written = self._written.get(budget_id)
                if state is None or not state.events.events:
                    continue
                if written is None or (
                    written[0] != state.events and time.monotonic() - written[1] >= KEEP_EVERY_SECONDS
                ):
                    due.append((budget_id, state))
        return due

    def keep(self, connection: Connection, budget_id: int, state: ComposedPld) -> None:
        """Keep `state` as the budget's, in place of the one kept before."""
        connection.execute(
            "INSERT INTO composed_pld (budget_id, state, at) VALUES (?, ?, ?) "
            "ON CONFLICT (budget_id) DO UPDATE SET state = excluded.state, at = excluded.at",
            (budget_id, state.to_bytes(self._key), now()),
        )
        with self._lock:
            self._written[budget_id] = (state.events, time.monotonic())
