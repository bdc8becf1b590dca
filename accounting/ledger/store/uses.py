"""The `tenant_use` table: each tenant's tally and committed events on each budget, and its quota where set."""

from __future__ import annotations

import json
from typing import NamedTuple

from accounting.events import Composition
from accounting.ledger.admission import AdmissionRule, RdpTally, canonical, committed_json_with
from accounting.ledger.databases import Connection
from accounting.ledger.store.datasets import DatasetRow
from accounting.ledger.verification import StoredTenantUse


class TenantUse(NamedTuple):
    """A tenant's tally of committed and reserved-unrun steps on a budget, and its committed events."""

    held: RdpTally
    committed: Composition


class Quota(NamedTuple):
    """A tenant's quota on a budget: its epsilon and the admission rule of (epsilon, the budget's delta)."""

    epsilon: float
    rule: AdmissionRule


class UseRow(NamedTuple):
    """A row of `tenant_use`, as stored (the quota's fields None where no quota is set)."""

    budget_id: int
    tenant: str
    quota_epsilon: float | None
    quota_rule: str | None
    held_rdp: str
    committed_events: str


_USE_COLUMNS = "u.budget_id, u.tenant, u.quota_epsilon, u.quota_rule, u.held_rdp, u.committed_events"


class TenantUses:
    """The rows of `tenant_use`; each method reads or writes on the connection it is given."""

    @staticmethod
    def use(connection: Connection, budget_id: int, tenant: str) -> TenantUse:
        """A tenant's tally and committed events on a budget (nothing for a tenant that never used it)."""
        row = connection.execute(
            "SELECT held_rdp, committed_events FROM tenant_use WHERE budget_id = ? AND tenant = ?", (budget_id, tenant)
        ).fetchone()
        if row is None:
            return TenantUse(RdpTally.zero(), Composition())
        return TenantUse(RdpTally.from_json(row[0]), Composition.from_json(row[1]))

    @staticmethod
    def set_use(connection: Connection, budget_id: int, tenant: str, held: RdpTally, committed: Composition) -> None:
        """Set a tenant's tally and committed events on a budget, keeping its quota."""
        connection.execute(
            "INSERT INTO tenant_use (budget_id, tenant, held_rdp, committed_events) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (budget_id, tenant) DO UPDATE SET held_rdp = excluded.held_rdp, "
            "committed_events = excluded.committed_events",
            (budget_id, tenant, held.to_json(), canonical(committed).to_json()),
        )

    @staticmethod
    def held(connection: Connection, budget_id: int, tenant: str) -> RdpTally:
        """A tenant's tally of committed and reserved-unrun steps on a budget (zero for one that never used it)."""
        row = connection.execute(
            "SELECT held_rdp FROM tenant_use WHERE budget_id = ? AND tenant = ?", (budget_id, tenant)
        ).fetchone()
        return RdpTally.from_json(row[0]) if row is not None else RdpTally.zero()

    @staticmethod
    def set_held(connection: Connection, budget_id: int, tenant: str, held: RdpTally) -> None:
        """Set a tenant's tally on a budget, keeping its committed events (not read: a reserve's or release's
        cost does not grow with the mechanisms they hold) and its quota."""
        connection.execute(
            "INSERT INTO tenant_use (budget_id, tenant, held_rdp, committed_events) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (budget_id, tenant) DO UPDATE SET held_rdp = excluded.held_rdp",
            (budget_id, tenant, held.to_json(), canonical(Composition()).to_json()),
        )

    @staticmethod
    def committed_json(connection: Connection, budget_id: int, tenant: str) -> str:
        """A tenant's committed events on a budget as stored (JSON; no events for a tenant that never used it)."""
        row = connection.execute(
            "SELECT committed_events FROM tenant_use WHERE budget_id = ? AND tenant = ?", (budget_id, tenant)
        ).fetchone()
        return row[0] if row is not None else Composition().to_json()

    @staticmethod
    def add_committed_events(connection: Connection, budget_id: int, tenant: str, block: Composition) -> str:
        """Add `block` to a tenant's committed events on a budget, keeping its tally and quota; the events as
        stored now."""
        committed = committed_json_with(TenantUses.committed_json(connection, budget_id, tenant), block)
        connection.execute(
            "INSERT INTO tenant_use (budget_id, tenant, held_rdp, committed_events) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (budget_id, tenant) DO UPDATE SET committed_events = excluded.committed_events",
            (budget_id, tenant, RdpTally.zero().to_json(), committed),
        )
        return committed

    @staticmethod
    def quota(connection: Connection, budget: DatasetRow, tenant: str) -> Quota | None:
        """The tenant's quota on a budget: its own, else (for a block) the one set on its dataset; None if none."""
        for budget_id in (budget.dataset_id, budget.block_of):
            if budget_id is None:
                continue
            row = connection.execute(
                "SELECT quota_epsilon, quota_rule FROM tenant_use WHERE budget_id = ? AND tenant = ? "
                "AND quota_epsilon IS NOT NULL",
                (budget_id, tenant),
            ).fetchone()
            if row is not None:
                return Quota(row[0], AdmissionRule.from_dict(json.loads(row[1])))
        return None

    @staticmethod
    def set_quota(connection: Connection, budget_id: int, tenant: str, quota: Quota) -> None:
        """Set the tenant's quota on a budget (its row exists: `set_use` first)."""
        connection.execute(
            "UPDATE tenant_use SET quota_epsilon = ?, quota_rule = ? WHERE budget_id = ? AND tenant = ?",
            (quota.epsilon, json.dumps(quota.rule.to_dict()), budget_id, tenant),
        )

    @staticmethod
    def has_quota_in(connection: Connection, tenant: str, owner: str, name: str) -> bool:
        """Whether the tenant holds a quota on `owner`'s dataset `name` or on one of its blocks (False when there
        is no such dataset: one read either way)."""
        return connection.execute(
            "SELECT 1 FROM datasets p JOIN datasets d ON d.id = p.id OR d.block_of = p.id "
            "JOIN tenant_use u ON u.budget_id = d.id "
            "WHERE p.tenant = ? AND p.name = ? AND p.block_of IS NULL AND u.tenant = ? "
            "AND u.quota_epsilon IS NOT NULL LIMIT 1",
            (owner, name, tenant),
        ).fetchone() is not None

    @staticmethod
    def of_dataset(connection: Connection, dataset_id: int, tenant: str | None) -> list[UseRow]:
        """The uses of the dataset and its blocks, by tenant and budget: every tenant's (None), or one's."""
        mine, parameters = ("", ()) if tenant is None else ("AND u.tenant = ?", (tenant,))
        return [
            UseRow(*row) for row in connection.execute(
                f"SELECT {_USE_COLUMNS} FROM tenant_use u JOIN datasets d ON d.id = u.budget_id "
                f"WHERE (d.id = ? OR d.block_of = ?) {mine} ORDER BY u.tenant, u.budget_id",
                (dataset_id, dataset_id, *parameters),
            ).fetchall()
        ]

    @staticmethod
    def every(connection: Connection) -> list[StoredTenantUse]:
        """Every use, by budget and tenant, as `verify` replays it against its history."""
        return [
            StoredTenantUse(
                row.budget_id, row.tenant, row.quota_epsilon,
                AdmissionRule.from_dict(json.loads(row.quota_rule)) if row.quota_rule else None,
                RdpTally.from_json(row.held_rdp), Composition.from_json(row.committed_events),
            )
            for row in (
                UseRow(*row) for row in connection.execute(
                    f"SELECT {_USE_COLUMNS} FROM tenant_use u ORDER BY budget_id, tenant"
                ).fetchall()
            )
        ]
