"""The `history` table: every change as an entry chained to the one before it under the history key.

The table refuses UPDATE and DELETE (and on PostgreSQL TRUNCATE); each entry
carries an HMAC under the history key over the entry and the hash of the one
before it (verification.history_hash), so `verify` finds an entry edited or removed by
hand, and nobody without the key can rewrite the chain to hide it.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import os
import secrets
from typing import NamedTuple

from accounting.ledger.callers import Caller, DatasetRef, display_name
from accounting.ledger.databases import Connection
from accounting.ledger.errors import FailedPrecondition
from accounting.ledger.records import HistoryEntry
from accounting.ledger.store.clock import now
from accounting.ledger.verification import StoredEntry, history_hash

HISTORY_COLUMNS = "id, at, actor, action, tenant, dataset_id, details, previous_hash, hash"


def by_key(caller: Caller, details: dict) -> dict:
    """The details of a change of authority (a token created, rotated or revoked, a budget or quota set), naming
    the key id of the token its caller acted with (None: no token, as the embedded ledger's local admin)."""
    return {**details, "actor_key_id": caller.key_id}


class ListedEntry(NamedTuple):
    """An entry as a caller lists it: with the tenant and name of its dataset (None for none) instead of its id."""

    entry_id: int
    at: str
    actor: str
    action: str
    dataset_tenant: str | None
    dataset_name: str | None
    details: str

    def entry(self, caller: Caller, shown_id: int) -> HistoryEntry:
        """The entry as `caller` sees it: under `shown_id` (HistoryChain.shown_id), its dataset named as the
        caller names it."""
        return HistoryEntry(
            entry_id=shown_id,
            at=self.at,
            actor=self.actor,
            action=self.action,
            dataset=(
                display_name(caller, DatasetRef(self.dataset_tenant, self.dataset_name))
                if self.dataset_name is not None else None
            ),
            details=json.loads(self.details),
        )


class HistoryChain:
    """The history of one ledger, chained under `key` (None: unkeyed, as files before schema version 9 were).

    `record` appends an entry; the first one a chain appends is refused when
    the last entry is not chained with `key` (`key_file` and `location` name
    the key and the database in that refusal), so a ledger opened with
    another key never chains to a history it cannot vouch for.
    """

    def __init__(self, key: bytes | None, key_file: str | os.PathLike | None, location: str) -> None:
        self.key = key
        self._key_file = key_file
        self._location = location
        # Entry ids as tenants see them are keyed by this: under the history key, stable across servers and
        # restarts; without one, random per process, since a public key would let a tenant invert them.
        self._id_key = hmac.new(key, b"dpfleet history entry ids", hashlib.sha256).digest() if key else (
            secrets.token_bytes(32)
        )
        # Whether this chain has seen that the history's last entry is chained with its key (at its first change).
        self._key_checked = False

    def record(
        self,
        connection: Connection,
        caller: Caller,
        action: str,
        tenant: str | None,
        dataset_id: int | None,
        details: dict,
    ) -> None:
        """Append one entry (who, what, on which tenant and dataset, JSON details), chained to the last."""
        if not self._key_checked:
            self._check_key(connection)
            self._key_checked = True
        last = connection.execute("SELECT id, hash FROM history ORDER BY id DESC LIMIT 1").fetchone()
        entry_id, previous = (last[0] + 1, last[1]) if last is not None else (1, "")
        at, details_json = now(), json.dumps(details, sort_keys=True)
        entry_hash = history_hash(
            previous, entry_id, at, caller.actor, action, tenant, dataset_id, details_json, self.key
        )
        connection.execute(
            f"INSERT INTO history ({HISTORY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (entry_id, at, caller.actor, action, tenant, dataset_id, details_json, previous, entry_hash),
        )

    def shown_id(self, caller: Caller, entry_id: int) -> int:
        """The id of entry `entry_id` as `caller` sees it: itself for the admin; for a tenant an opaque number
        (63 bits of an HMAC of tenant and id), since the global ids of its own entries would count the changes
        other tenants made between them."""
        if caller.admin:
            return entry_id
        tag = hmac.new(self._id_key, f"{caller.tenant}\n{entry_id}".encode(), hashlib.sha256).digest()
        return int.from_bytes(tag[:8], "big") >> 1

    def _check_key(self, connection: Connection) -> None:
        """Refuse a key the history was not chained with, before a change chains an entry to it under another."""
        last = connection.execute(f"SELECT {HISTORY_COLUMNS} FROM history ORDER BY id DESC LIMIT 1").fetchone()
        if last is not None:
            entry = StoredEntry(*last)
            expected = history_hash(
                entry.previous_hash, entry.entry_id, entry.at, entry.actor, entry.action, entry.tenant,
                entry.dataset_id, entry.details_json, self.key,
            )
            if entry.entry_hash != expected:
                raise FailedPrecondition(
                    f"the last history entry of {self._location} is not chained with the history key "
                    f"{self._key_file}: give the key this ledger was opened with (--history-key), or "
                    "restore it from its backup; dpfleet ledger verify tells whether the row was edited. See "
                    "docs/ledger.md, 'The history key and the signed head'"
                )

    @staticmethod
    def entries(connection: Connection) -> list[StoredEntry]:
        """Every entry, oldest first, as stored."""
        return [
            StoredEntry(*row)
            for row in connection.execute(f"SELECT {HISTORY_COLUMNS} FROM history ORDER BY id").fetchall()
        ]

    @staticmethod
    def of_budgets(connection: Connection, budget_ids: list[int]) -> list[StoredEntry]:
        """Every entry about the budgets `budget_ids` (a dataset and its blocks), every tenant's, oldest first, as
        stored: each budget's read along its index (history_by_dataset), merged by id."""
        return list(heapq.merge(*(
            map(StoredEntry._make, connection.execute(
                f"SELECT {HISTORY_COLUMNS} FROM history WHERE dataset_id = ? ORDER BY id", (budget_id,)
            ).fetchall())
            for budget_id in budget_ids
        )))

    @staticmethod
    def head(connection: Connection) -> tuple[int, str]:
        """How many entries the history has, and the hash of the last ("" for none)."""
        (entries,) = connection.execute("SELECT COUNT(*) FROM history").fetchone()
        last = connection.execute("SELECT hash FROM history ORDER BY id DESC LIMIT 1").fetchone()
        return entries, last[0] if last else ""

    @staticmethod
    def listed(
        connection: Connection, dataset_id: int | None, tenant: str | None, limit: int
    ) -> list[ListedEntry]:
        """The newest `limit` entries, oldest first: of one dataset and its blocks, and of one tenant (None: any).

        Each of the dataset's budgets is read backwards along its index
        (history_by_dataset, or history_by_dataset_and_tenant) for at most
        `limit` entries, so the time follows `limit` and the number of
        blocks, not the length of the history.
        """
        select = (
            "SELECT h.id, h.at, h.actor, h.action, d.tenant, d.name, h.details FROM history h "
            "LEFT JOIN datasets d ON d.id = h.dataset_id"
        )
        mine, tenant_parameters = ("AND h.tenant = ?", (tenant,)) if tenant is not None else ("", ())
        if dataset_id is None:
            where = "WHERE h.tenant = ?" if tenant is not None else ""
            rows = connection.execute(f"{select} {where} ORDER BY h.id DESC LIMIT ?", (*tenant_parameters, limit))
            return [ListedEntry(*row) for row in reversed(rows.fetchall())]
        # A block's own entries (its creation, quotas on it) are the dataset's too.
        budgets = [dataset_id] + [
            block_id for (block_id,) in connection.execute(
                "SELECT id FROM datasets WHERE block_of = ? ORDER BY block", (dataset_id,)
            ).fetchall()
        ]
        newest = heapq.nlargest(limit, (
            row for budget_id in budgets for row in connection.execute(
                f"{select} WHERE h.dataset_id = ? {mine} ORDER BY h.id DESC LIMIT ?",
                (budget_id, *tenant_parameters, limit),
            ).fetchall()
        ))
        return [ListedEntry(*row) for row in reversed(newest)]
