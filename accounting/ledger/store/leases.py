"""Leases: a reservation may expire `lease_seconds` after its reserve or its last commit.

Every reserve and release on its dataset, a commit to it, and the sweep a
server runs every second first release the unrun steps of the reservations
whose lease ran out, and serve the queues of the datasets that freed budget.
A commit to an expired reservation is refused, so a driver that lost its
lease cannot charge steps the ledger already freed.
"""

from __future__ import annotations

from accounting.ledger.callers import LEASE_EXPIRY
from accounting.ledger.databases import Connection
from accounting.ledger.store.admission import free
from accounting.ledger.store.queueing import serve_queue
from accounting.ledger.store.tables import Tables


def expire_leases(tables: Tables, connection: Connection, dataset_id: int | None) -> None:
    """Release the unrun steps of the reservations whose lease ran out, on one dataset or (None) on all."""
    expired = tables.reservations.expired(connection, dataset_id)
    for row in expired:
        free(tables, connection, LEASE_EXPIRY, row, "expire")
    for freed_dataset_id in sorted({row.dataset_id for row in expired}):
        serve_queue(tables, connection, freed_dataset_id)
