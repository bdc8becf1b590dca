"""Verification: the history's keyed chain checked, and every row replayed against the history that made it.

`head` signs the chain's head with the history key; `verify` with a head
kept elsewhere finds a tail cut off together with the rows it changed. The
`verified_state` row keeps the replays' state at the last entry a verify
found nothing wrong up to, so the next one replays only the entries after.
"""

from __future__ import annotations

from typing import NamedTuple

from accounting.ledger.databases import Connection
from accounting.ledger.store.clock import now
from accounting.ledger.store.history import HISTORY_COLUMNS
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
    VerifiedState,
    verify_history,
)


class StoredLedger(NamedTuple):
    """Every row `verify` replays, read in one snapshot, and the state the last verify kept (None: none)."""

    entries: list[StoredEntry]
    datasets: list[StoredDataset]
    uses: list[StoredTenantUse]
    reservations: list[StoredReservation]
    commits: list[StoredCommit]
    tenants: list[StoredTenant]
    verified: bytes | None


def read_stored(tables: Tables, connection: Connection) -> StoredLedger:
    """Every history entry, dataset and block, tenant use, reservation, commit and tenant, as
    stored, and the verified state."""
    verified = connection.execute("SELECT state FROM verified_state WHERE id = 1").fetchone()
    return StoredLedger(
        entries=list(map(StoredEntry._make, connection.execute(f"SELECT {HISTORY_COLUMNS} FROM history ORDER BY id"))),
        datasets=[row.stored() for row in tables.datasets.every(connection)],
        uses=tables.uses.every(connection),
        reservations=tables.reservations.every(connection),
        commits=tables.reservations.every_commit(connection),
        tenants=tables.tenants.every(connection),
        verified=bytes(verified[0]) if verified is not None else None,
    )


def verify_stored(
    stored: StoredLedger, key: bytes, head: SignedHead | None, full: bool
) -> tuple[Verification, VerifiedState | None]:
    """What is wrong with what was stored: its chain under `key`, each row against its history (replayed from
    the verified state unless `full`), and with `head`, whether the history extends it; and the state to keep."""
    return verify_history(
        stored.entries, stored.datasets, stored.uses, key=key, reservations=stored.reservations,
        commits=stored.commits, tenants=stored.tenants, head=head, verified=stored.verified, full=full,
    )


def keep_verified_state(connection: Connection, state: VerifiedState, key: bytes) -> None:
    """Keep `state` as the verified state, in place of the one kept before."""
    connection.execute(
        "INSERT INTO verified_state (id, state, at) VALUES (1, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET state = excluded.state, at = excluded.at",
        (state.to_bytes(key), now()),
    )
