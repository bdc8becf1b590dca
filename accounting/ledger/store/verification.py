"""Verification: the history's keyed chain checked, and every row replayed against the history that made it.

`head` signs the chain's head with the history key; `verify` with a head
kept elsewhere finds a tail cut off together with the rows it changed. The
`verified_state` row keeps the replays' state at the last entry a verify
found nothing wrong up to, so the next one replays only the entries after;
a new ledger and each migration seal one (`keep_sealed_state`), so that the
schema version and the head it had are under the key from then on.
"""

from __future__ import annotations

from typing import NamedTuple

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from accounting.ledger.databases import Connection
from accounting.ledger.store.clock import now
from accounting.ledger.store.history import HISTORY_COLUMNS, HistoryChain
from accounting.ledger.store.tables import Tables
from accounting.ledger.verification import (
    SignedHead,
    StoredAdminToken,
    StoredCommit,
    StoredDataset,
    StoredEntry,
    StoredPlan,
    StoredPlanJob,
    StoredReservation,
    StoredTenant,
    StoredTenantUse,
    Verification,
    VerifiedState,
    verify_history,
)


class StoredLedger(NamedTuple):
    """Every row `verify` replays, read in one snapshot, the state the last verify kept (None: none), and the
    schema version the file says it has."""

    entries: list[StoredEntry]
    datasets: list[StoredDataset]
    uses: list[StoredTenantUse]
    reservations: list[StoredReservation]
    commits: list[StoredCommit]
    tenants: list[StoredTenant]
    admin_tokens: list[StoredAdminToken]
    verified: bytes | None
    schema_version: int
    plans: list[StoredPlan]
    plan_jobs: list[StoredPlanJob]


def read_stored(tables: Tables, connection: Connection) -> StoredLedger:
    """Every history entry, dataset and block, tenant use, reservation, commit, tenant and admin token, plan and
    plan job, as stored, the verified state and the schema version."""
    verified = connection.execute("SELECT state FROM verified_state WHERE id = 1").fetchone()
    (schema_version,) = connection.execute("SELECT version FROM schema_version").fetchone()
    return StoredLedger(
        entries=list(map(StoredEntry._make, connection.execute(f"SELECT {HISTORY_COLUMNS} FROM history ORDER BY id"))),
        datasets=[row.stored() for row in tables.datasets.every(connection)],
        uses=tables.uses.every(connection),
        reservations=tables.reservations.every(connection),
        commits=tables.reservations.every_commit(connection),
        tenants=tables.tenants.every(connection),
        admin_tokens=tables.tenants.every_admin_token(connection),
        verified=bytes(verified[0]) if verified is not None else None,
        schema_version=schema_version,
        plans=tables.plans.every(connection),
        plan_jobs=tables.plans.every_job(connection),
    )


def verify_stored(
    stored: StoredLedger, key: bytes, head: SignedHead | None, full: bool,
    head_public_key: Ed25519PublicKey | None = None,
) -> tuple[Verification, VerifiedState | None]:
    """What is wrong with what was stored: its chain under `key`, each row against its history (replayed from
    the verified state unless `full`), and with `head` (Ed25519-signed: checked with `head_public_key`), whether
    the history extends it; and the state to keep."""
    return verify_history(
        stored.entries, stored.datasets, stored.uses, key=key, reservations=stored.reservations,
        commits=stored.commits, tenants=stored.tenants, admin_tokens=stored.admin_tokens,
        schema_version=stored.schema_version, head=head, verified=stored.verified, full=full,
        head_public_key=head_public_key, plans=stored.plans, plan_jobs=stored.plan_jobs,
    )


def keep_verified_state(connection: Connection, state: VerifiedState, key: bytes) -> None:
    """Keep `state` as the verified state, in place of the one kept before."""
    connection.execute(
        "INSERT INTO verified_state (id, state, at) VALUES (1, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET state = excluded.state, at = excluded.at",
        (state.to_bytes(key), now()),
    )


def keep_sealed_state(connection: Connection, key: bytes, schema_version: int) -> None:
    """Keep, as the verified state, the history's head and `schema_version` under the key, with no replay (a
    creation or migration verified no row): a later file whose version number is lowered, or whose state is
    deleted, is then refused or a finding."""
    entries, head_hash = HistoryChain.head(connection)
    last = connection.execute("SELECT MAX(id) FROM history").fetchone()[0] or 0
    keep_verified_state(connection, VerifiedState(entries, last, head_hash, schema_version, None), key)
