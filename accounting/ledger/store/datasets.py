"""The `datasets` table: each dataset's and each block's budget, admission rule, tally and committed events.

A block is a row of its own (`block_of` its dataset's id), so every budget a
job may be charged to is one row.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from accounting.events import Composition
from accounting.ledger.admission import AdmissionRule, RdpTally, committed_json_with
from accounting.ledger.databases import Connection, Database
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.store.clock import now
from accounting.ledger.verification import StoredDataset

_DATASET_COLUMNS = (
    "id, tenant, name, budget_epsilon, delta, held_rdp, committed_events, released_jobs, admission_rule, privacy_unit, "
    "block_of, block, scheduling, arrived_jobs, created_at, block_data"
)


class DatasetRow(NamedTuple):
    """A row of `datasets`: a dataset, or one block of a dataset (`block_of` and `block` set)."""

    dataset_id: int
    tenant: str
    name: str
    budget_epsilon: float
    delta: float
    held_rdp: str
    committed_events: str
    released_jobs: int
    admission_rule: str
    privacy_unit: str
    block_of: int | None
    block: str | None
    scheduling: str
    arrived_jobs: int
    created_at: str
    block_data: str | None

    def rule(self) -> AdmissionRule:
        """The budget's admission rule."""
        return AdmissionRule.from_dict(json.loads(self.admission_rule))

    def stored(self) -> StoredDataset:
        """The row as `verify` replays it against its history."""
        return StoredDataset(
            dataset_id=self.dataset_id,
            name=f"{self.tenant}/{self.name}",
            budget_epsilon=self.budget_epsilon,
            delta=self.delta,
            admission=self.rule(),
            held=RdpTally.from_json(self.held_rdp),
            committed_events=Composition.from_json(self.committed_events),
            block_of=self.block_of,
            block=self.block,
            data=json.loads(self.block_data) if self.block_data else None,
        )


def content_holder(
    recorded: dict[int, set[str]], content: list[str], besides: int | None = None
) -> tuple[int, str] | None:
    """(id, a shared digest) of a dataset of `recorded` (`Datasets.recorded_content`) other than `besides` that
    holds a file of `content`, or None."""
    wanted = set(content)
    for dataset_id, files in recorded.items():
        shared = wanted & files
        if shared and dataset_id != besides:
            return dataset_id, min(shared)
    return None


class Datasets:
    """The rows of `datasets` in `database`; each method reads or writes on the connection it is given."""

    def __init__(self, database: Database) -> None:
        self._database = database

    @staticmethod
    def named(connection: Connection, tenant: str, name: str) -> DatasetRow | None:
        """Tenant `tenant`'s dataset `name` (never a block), or None."""
        row = connection.execute(
            f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE tenant = ? AND name = ? AND block_of IS NULL",
            (tenant, name),
        ).fetchone()
        return DatasetRow(*row) if row is not None else None

    @staticmethod
    def by_id(connection: Connection, dataset_id: int) -> DatasetRow:
        """The dataset or block of `dataset_id` (which exists)."""
        return DatasetRow(
            *connection.execute(f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE id = ?", (dataset_id,)).fetchone()
        )

    @staticmethod
    def blocks(connection: Connection, dataset_id: int) -> list[DatasetRow]:
        """The blocks of a dataset, by name."""
        return [
            DatasetRow(*row) for row in connection.execute(
                f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE block_of = ? ORDER BY block", (dataset_id,)
            ).fetchall()
        ]

    @staticmethod
    def every(connection: Connection) -> list[DatasetRow]:
        """Every dataset and block, by id."""
        return [
            DatasetRow(*row)
            for row in connection.execute(f"SELECT {_DATASET_COLUMNS} FROM datasets ORDER BY id").fetchall()
        ]

    @staticmethod
    def listed(connection: Connection, tenant: str | None) -> list[DatasetRow]:
        """The datasets (no blocks) by tenant and name: all of them (`tenant` None), or those `tenant` may see."""
        if tenant is None:
            rows = connection.execute(
                f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE block_of IS NULL ORDER BY tenant, name"
            )
        else:
            # Its own datasets, and those where it holds a quota on the dataset or one of its blocks.
            rows = connection.execute(
                f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE block_of IS NULL AND (tenant = ? OR id IN "
                "(SELECT COALESCE(d.block_of, d.id) FROM tenant_use u JOIN datasets d ON d.id = u.budget_id "
                "WHERE u.tenant = ? AND u.quota_epsilon IS NOT NULL)) ORDER BY tenant, name",
                (tenant, tenant),
            )
        return [DatasetRow(*row) for row in rows.fetchall()]

    @staticmethod
    def recorded_content(connection: Connection) -> dict[int, set[str]]:
        """The SHA-256s of the files each dataset was registered or bound with, by dataset id.

        Read from the datasets' `create_dataset` entries (a first-use
        registration's training files) and `bind_content` entries (a job's
        files bound to a dataset created without them).
        """
        content: dict[int, set[str]] = {}
        for dataset_id, details in connection.execute(
            "SELECT dataset_id, details FROM history WHERE action IN ('create_dataset', 'bind_content') "
            "AND details LIKE ?",
            ('%"content"%',),
        ).fetchall():
            content.setdefault(dataset_id, set()).update(json.loads(details).get("content") or ())
        return content

    def holding_content(
        self, connection: Connection, content: list[str], besides: int | None = None
    ) -> tuple[int, str] | None:
        """(id, a shared digest) of a dataset other than `besides` that holds a file of `content`, or None."""
        return content_holder(self.recorded_content(connection), content, besides)

    def insert_dataset(
        self, connection: Connection, tenant: str, name: str, epsilon: float, delta: float, rule: AdmissionRule,
        privacy_unit: str, scheduling: SchedulingPolicy,
    ) -> int | None:
        """Add a dataset with nothing held or committed; its id, or None when the tenant has one of that name."""
        try:
            (dataset_id,) = connection.execute(
                "INSERT INTO datasets (tenant, name, budget_epsilon, delta, held_rdp, committed_events, "
                "created_at, admission_rule, privacy_unit, scheduling) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "RETURNING id",
                (
                    tenant, name, epsilon, delta, RdpTally.zero().to_json(), Composition().to_json(), now(),
                    json.dumps(rule.to_dict()), privacy_unit, json.dumps(scheduling.to_dict()),
                ),
            ).fetchone()
        except self._database.duplicate_errors:
            return None
        return dataset_id

    def insert_block(
        self, connection: Connection, dataset: DatasetRow, block: str, epsilon: float, delta: float,
        rule: AdmissionRule, data: dict,
    ) -> int | None:
        """Add a block of `dataset` declaring `data`; its id, or None when the dataset has a block of that name."""
        try:
            (block_id,) = connection.execute(
                "INSERT INTO datasets (tenant, name, budget_epsilon, delta, held_rdp, committed_events, "
                "created_at, admission_rule, privacy_unit, block_of, block, block_data) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (
                    # ':' is in no dataset name, so a block's row never takes a dataset's name.
                    dataset.tenant, f"{dataset.name}:{block}", epsilon, delta, RdpTally.zero().to_json(),
                    Composition().to_json(), now(), json.dumps(rule.to_dict()), dataset.privacy_unit,
                    dataset.dataset_id, block, json.dumps(data, sort_keys=True),
                ),
            ).fetchone()
        except self._database.duplicate_errors:
            return None
        return block_id

    @staticmethod
    def largest_block_epsilon(connection: Connection, dataset_id: int) -> float | None:
        """The largest budget epsilon of a block of the dataset, None for a dataset without blocks."""
        (largest,) = connection.execute(
            "SELECT MAX(budget_epsilon) FROM datasets WHERE block_of = ?", (dataset_id,)
        ).fetchone()
        return largest

    @staticmethod
    def set_budget(connection: Connection, dataset_id: int, epsilon: float) -> None:
        """Set a budget's epsilon."""
        connection.execute("UPDATE datasets SET budget_epsilon = ? WHERE id = ?", (epsilon, dataset_id))

    @staticmethod
    def held(connection: Connection, budget_id: int) -> RdpTally:
        """A budget's tally of committed and reserved-unrun steps, as it is now in this transaction."""
        (held,) = connection.execute("SELECT held_rdp FROM datasets WHERE id = ?", (budget_id,)).fetchone()
        return RdpTally.from_json(held)

    @staticmethod
    def set_held(connection: Connection, budget_id: int, held: RdpTally) -> None:
        """Set a budget's tally of committed and reserved-unrun steps."""
        connection.execute("UPDATE datasets SET held_rdp = ? WHERE id = ?", (held.to_json(), budget_id))

    @staticmethod
    def add_committed_events(connection: Connection, budget: DatasetRow, block: Composition) -> str:
        """Add `block` to the committed events of `budget` (its row as read in this transaction), stored
        canonical (one record per mechanism); the events as stored now."""
        committed = committed_json_with(budget.committed_events, block)
        connection.execute("UPDATE datasets SET committed_events = ? WHERE id = ?", (committed, budget.dataset_id))
        return committed

    @staticmethod
    def count_arrival(connection: Connection, budgets: list[DatasetRow]) -> None:
        """A job arrived on `budgets` (the dataset, or the blocks it names): what DPF-N unlocks by."""
        for budget in budgets:
            connection.execute("UPDATE datasets SET arrived_jobs = arrived_jobs + 1 WHERE id = ?", (budget.dataset_id,))

    @staticmethod
    def count_released(connection: Connection, dataset_id: int) -> None:
        """One more job of the dataset was released."""
        connection.execute("UPDATE datasets SET released_jobs = released_jobs + 1 WHERE id = ?", (dataset_id,))
