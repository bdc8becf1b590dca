"""Verification: the history's keyed chain checked, and every row replayed against the history that made it.

`head` signs the chain's head with the history key; `verify` with a head
kept elsewhere finds a tail cut off together with the rows it changed.
"""

from __future__ import annotations

from typing import NamedTuple

from accounting.ledger.databases import Connection
from accounting.ledger.store.tables import Tables
from accounting.ledger.verification import (
    SignedHead,
    StoredCommit,
    StoredDataset,
    StoredEntry,
    StoredReservation,
    StoredTenant,
    StoredTenantUse,
    Verification,
    verify_history,
)


class StoredLedger(NamedTuple):
    """Every row `verify` replays, read in one snapshot."""

    entries: list[StoredEntry]
    datasets: list[StoredDataset]
    uses: list[StoredTenantUse]
    reservations: list[StoredReservation]
    commits: list[StoredCommit]
    tenants: list[StoredTenant]


def read_stored(tables: Tables, connection: Connection) -> StoredLedger:
    """Every history entry, dataset and block, tenant use, reservation, commit and tenant, as stored."""
    return StoredLedger(
        entries=tables.history.entries(connection),
        datasets=[row.stored() for row in tables.datasets.every(connection)],
        uses=tables.uses.every(connection),
        reservations=tables.reservations.every(connection),
        commits=tables.reservations.every_commit(connection),
        tenants=tables.tenants.every(connection),
    )


def verify_stored(stored: StoredLedger, key: bytes, head: SignedHead | None) -> Verification:
    """What is wrong with what was stored: its chain under `key`, each row against its history, and with
    `head`, whether the history extends it."""
    return verify_history(
        stored.entries, stored.datasets, stored.uses, key=key, reservations=stored.reservations,
        commits=stored.commits, tenants=stored.tenants, head=head,
    )
