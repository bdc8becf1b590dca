"""What the ledger's web page shows, as one JSON-ready dict: `ledger_view`.

The page draws whatever this returns; it reads the ledger only through the
store's own queries (statuses, jobs, history), as the caller, so a tenant's
view holds only its own datasets. The one exception is a dataset's
burn-down, replayed from every tenant's entries on it so that it ends at
the dataset's status; it shows aggregate figures only.

Each dataset carries its status (the `dpfleet ledger status --json` shape),
its burn-down over time, and a list of tables; each tenant a list of tables.
A table is {"title", "columns", "rows"}. The tables come from the functions
in `DATASET_TABLES` and `TENANT_TABLES`, in order: another part of the ledger
shows itself on the page by adding its function there.
"""

from __future__ import annotations

from datetime import datetime, timezone
from itertools import groupby
from typing import Callable

from accounting.ledger.callers import ADMIN, Caller
from accounting.ledger.records import DatasetStatus
from accounting.ledger.store import Ledger
from accounting.ledger.validation import HISTORY_LIMIT
from accounting.ledger.verification import burn_down

# The newest changes a burn-down replays; a dataset with more shows its figures and tables without the chart.
BURN_DOWN_ENTRIES = HISTORY_LIMIT[1]


def table(title: str, columns: list[str], rows: list[list]) -> dict:
    """A table of the page: a title, column headings and rows of JSON values."""
    return {"title": title, "columns": columns, "rows": rows}


def jobs_table(ledger: Ledger, caller: Caller, status: DatasetStatus) -> dict:
    """Every reservation on the dataset, oldest first, with its steps and lease."""
    jobs = ledger.list_jobs(status.name, caller=caller)
    rows = [
        [
            job.reservation_id, job.job_id, "lease expired" if job.lease_expired else job.state,
            job.committed_steps, job.planned_steps, job.created_at, job.released_at, job.expires_at,
        ]
        for job in jobs
    ]
    columns = ["reservation", "job", "state", "committed steps", "planned steps", "created", "released", "lease ends"]
    return table("jobs", columns, rows)


def datasets_table(ledger: Ledger, caller: Caller, tenant: str, statuses: list[DatasetStatus]) -> dict:
    """The tenant's datasets and the ε each has left, per its privacy unit at its own δ."""
    rows = [
        [status.name, status.privacy_unit, status.budget_epsilon, status.delta, status.spent_epsilon_filter,
         status.reserved_epsilon, status.remaining_epsilon, len(status.jobs)]
        for status in statuses
    ]
    columns = [
        "dataset", "privacy unit", "budget ε", "δ", "spent ε (filter)", "reserved ε", "remaining ε", "active jobs",
    ]
    return table("datasets", columns, rows)


def queue_table(ledger: Ledger, caller: Caller, status: DatasetStatus) -> dict:
    """The jobs waiting for budget on the dataset, next first, with why each waits (its dataset's policy decides)."""
    waiting = ledger.list_queued(status.name, caller=caller)
    rows = [
        [job.position, job.queue_id, job.job_id, job.priority, job.planned.steps, job.created_at, job.deadline,
         job.reason]
        for job in waiting
    ]
    columns = ["position", "queue id", "job", "priority", "planned steps", "queued", "gives up at", "waits because"]
    return table(f"queue ({status.scheduling.name})", columns, rows)


def blocks_table(ledger: Ledger, caller: Caller, status: DatasetStatus) -> dict:
    """The dataset's blocks, each with its own budget and what its filter counts, at the block's δ."""
    rows = [
        [block.name, block.budget_epsilon, block.delta, block.spent_epsilon_filter, block.reserved_epsilon,
         block.remaining_epsilon]
        for block in status.blocks
    ]
    return table("blocks", ["block", "budget ε", "δ", "spent ε (filter)", "reserved ε", "remaining ε"], rows)


def quotas_table(ledger: Ledger, caller: Caller, status: DatasetStatus) -> dict:
    """Each tenant's quota on the dataset or a block, and its use (a tenant sees only its own)."""
    rows = [
        [quota.tenant, quota.block or "(whole dataset)", quota.quota_epsilon, quota.spent_epsilon_filter,
         quota.reserved_epsilon, quota.remaining_epsilon, "yes" if quota.inherited else "no"]
        for quota in status.quotas
    ]
    columns = ["tenant", "on", "quota ε", "spent ε (filter)", "reserved ε", "remaining ε", "from the dataset's"]
    return table("tenant quotas", columns, rows)


DATASET_TABLES: list[Callable[[Ledger, Caller, DatasetStatus], dict]] = [
    blocks_table, quotas_table, jobs_table, queue_table,
]
TENANT_TABLES: list[Callable[[Ledger, Caller, str, list[DatasetStatus]], dict]] = [datasets_table]


def dataset_burn_down(ledger: Ledger, caller: Caller, status: DatasetStatus) -> list[dict] | None:
    """The dataset's figures after each change, or None when its history is longer than BURN_DOWN_ENTRIES.

    Replayed from every tenant's entries on the dataset, as its status
    counts them: a caller who may see the dataset sees its aggregate figures
    over time, never another tenant's jobs or their details.
    """
    bare_name = status.name.rsplit("/", 1)[-1]
    entries = ledger.history(f"{status.tenant}/{bare_name}", BURN_DOWN_ENTRIES, caller=ADMIN)
    # Its creation is older than the newest BURN_DOWN_ENTRIES.
    if not entries or entries[0].action != "create_dataset":
        return None
    return [point.to_dict() for point in burn_down(entries)]


def ledger_view(ledger: Ledger, caller: Caller) -> dict:
    """Everything the page shows to `caller`: its tenants' tables, and per dataset its status, burn-down and tables.

    Figures wait for the PLD ε as `dpfleet ledger status` does, so they
    equal its --json output at the same moment.
    """
    statuses = ledger.list_datasets(caller=caller)
    tenants = [
        {
            "tenant": tenant,
            "tables": [make(ledger, caller, tenant, list(of_tenant)) for make in TENANT_TABLES],
        }
        for tenant, of_tenant in groupby(statuses, key=lambda status: status.tenant)
    ]
    datasets = [
        {
            "name": status.name,
            "tenant": status.tenant,
            "status": status.to_dict(),
            "burn_down": dataset_burn_down(ledger, caller, status),
            "tables": [make(ledger, caller, status) for make in DATASET_TABLES],
        }
        for status in statuses
    ]
    return {
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "viewer": {"actor": caller.actor, "tenant": caller.tenant, "admin": caller.admin},
        "tenants": tenants,
        "datasets": datasets,
    }
