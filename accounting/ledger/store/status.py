"""A dataset's status: read from the tables inside a transaction, computed on outside it (no lock held)."""

from __future__ import annotations

import functools
import json
from typing import Callable, Hashable, NamedTuple

from accounting.events import Composition
from accounting.ledger.admission import AdmissionRule, PoolUse, RdpTally, budget_figures, stored_tally
from accounting.ledger.callers import Caller, DatasetRef, display_name
from accounting.ledger.databases import Connection
from accounting.ledger.records import BlockStatus, DatasetStatus, QuotaStatus, quota_status
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.store.datasets import DatasetRow
from accounting.ledger.store.reservations import ReservationRow
from accounting.ledger.store.tables import Tables
from accounting.ledger.store.uses import UseRow
from accounting.ledger.validation import ACTIVE


class StatusRows(NamedTuple):
    """What a dataset's status is computed from: its row, its active jobs, its blocks, the uses of it and of
    its blocks, how many jobs wait on it, and what its plans took from its plan pool."""

    dataset: DatasetRow
    jobs: list[ReservationRow]
    blocks: list[DatasetRow]
    uses: list[UseRow]
    queued: int
    pool_use: PoolUse


def read_status(tables: Tables, connection: Connection, caller: Caller, dataset: DatasetRow) -> StatusRows:
    """What a status needs from the tables. A tenant sees its own jobs and quotas only; an admin every tenant's."""
    mine = None if caller.admin else caller.tenant
    rows = StatusRows(
        dataset,
        tables.reservations.listed(connection, dataset.dataset_id, mine, ACTIVE),
        tables.datasets.blocks(connection, dataset.dataset_id),
        tables.uses.of_dataset(connection, dataset.dataset_id, mine),
        tables.queue.count_waiting(connection, dataset.dataset_id),
        tables.plans.pool_use(connection, dataset.dataset_id),
    )
    tables.composed.recall(connection, [rows.dataset, *rows.blocks])
    return rows


def budget_ids(rows: StatusRows) -> list[int]:
    """The dataset's and its blocks' ids: the budgets whose figures a status shows."""
    return [rows.dataset.dataset_id, *(block.dataset_id for block in rows.blocks)]


def dataset_status(
    caller: Caller, rows: StatusRows, pld_may_be_pending: bool = False,
    lineage: Callable[[int], Hashable] | None = None,
) -> DatasetStatus:
    """The status of a dataset as `caller` sees it (see `Ledger.get_budget` for `pld_may_be_pending`).

    `lineage` names each budget's composed PLD, extended by new commits
    (ComposedDistributions.lineage); None composes each from the start.
    """
    # The PLD epsilon of new commits takes one composition; no lock is held here.
    dataset = rows.dataset
    fields = functools.partial(_budget_fields, pld_may_be_pending=pld_may_be_pending, lineage=lineage)
    return DatasetStatus(
        name=display_name(caller, DatasetRef(dataset.tenant, dataset.name)),
        tenant=dataset.tenant,
        **fields(dataset),
        jobs=tuple(job.reservation(caller) for job in rows.jobs),
        released_jobs=dataset.released_jobs,
        blocks=tuple(
            BlockStatus(name=block.block, **fields(block),
                        data=json.loads(block.block_data) if block.block_data else None)
            for block in rows.blocks
        ),
        quotas=_quota_statuses(dataset, rows.blocks, rows.uses),
        privacy_unit=dataset.privacy_unit,
        scheduling=SchedulingPolicy.from_dict(json.loads(dataset.scheduling)),
        queued_jobs=rows.queued,
        plans=rows.pool_use.plans,
        plans_epsilon=rows.pool_use.epsilon,
        plans_delta=rows.pool_use.delta,
    )


def _budget_fields(
    budget: DatasetRow, pld_may_be_pending: bool, lineage: Callable[[int], Hashable] | None
) -> dict:
    """A dataset's or block's budget, rule and figures, as the fields its status shares with the other's."""
    rule = budget.rule()
    figures = budget_figures(
        budget.budget_epsilon, rule, Composition.from_json(budget.committed_events),
        stored_tally(budget.committed_events), RdpTally.from_json(budget.held_rdp), pld_may_be_pending,
        lineage(budget.dataset_id) if lineage is not None else None,
    )
    return {
        "budget_epsilon": budget.budget_epsilon,
        "delta": budget.delta,
        "admission": rule,
        "spent_epsilon": figures.spent_epsilon,
        "spent_epsilon_rdp": figures.spent_epsilon_rdp,
        "spent_epsilon_filter": figures.spent_epsilon_filter,
        "reserved_epsilon": figures.reserved_epsilon,
        "remaining_epsilon": figures.remaining_epsilon,
        "spent_epsilon_accountant": figures.spent_epsilon_accountant,
    }


def _quota_statuses(dataset: DatasetRow, blocks: list[DatasetRow], uses: list[UseRow]) -> tuple[QuotaStatus, ...]:
    """Each tenant's quota on the dataset and on each block; a quota set on the dataset stands in for a
    block that has none of its own."""
    by_budget = {(use.budget_id, use.tenant): use for use in uses}
    statuses = []
    for tenant in sorted({use.tenant for use in uses}):
        dataset_quota = by_budget.get((dataset.dataset_id, tenant))
        for budget in [dataset, *blocks]:
            use = by_budget.get(
                (budget.dataset_id, tenant),
                UseRow(budget.dataset_id, tenant, None, None, RdpTally.zero().to_json(), Composition().to_json()),
            )
            quota_epsilon, quota_rule = use.quota_epsilon, use.quota_rule
            inherited = quota_epsilon is None and budget is not dataset and dataset_quota is not None
            if inherited:
                quota_epsilon, quota_rule = dataset_quota.quota_epsilon, dataset_quota.quota_rule
            if quota_epsilon is None:
                continue
            statuses.append(
                quota_status(
                    tenant, budget.block, quota_epsilon, AdmissionRule.from_dict(json.loads(quota_rule)),
                    stored_tally(use.committed_events), RdpTally.from_json(use.held_rdp), inherited,
                )
            )
    return tuple(statuses)
