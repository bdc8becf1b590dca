"""`verify`: the whole history checked, its chain and head, each budget's replay and every table."""

from __future__ import annotations

import json

from accounting.events import EventError
from accounting.ledger.verification.chain import SignedHead, chain_findings, head_findings
from accounting.ledger.verification.findings import Finding, Verification
from accounting.ledger.verification.replay import JOB_ACTIONS, replay_findings, use_findings
from accounting.ledger.verification.rows import (
    StoredCommit,
    StoredDataset,
    StoredEntry,
    StoredReservation,
    StoredTenant,
    StoredTenantUse,
)
from accounting.ledger.verification.tables import job_findings, queue_findings, tenant_findings
from accounting.ledger.verification.units import unit_findings


def _budgets_of(entry: StoredEntry, block_ids: dict[tuple[int, str], int]) -> list[int]:
    """The budgets (dataset or block rows) an entry is about: a job's entries name the blocks it is charged to."""
    if entry.action in JOB_ACTIONS:
        blocks = json.loads(entry.details_json).get("blocks") or ()
        if blocks:
            return [block_ids.get((entry.dataset_id, block), -1) for block in blocks]
    return [entry.dataset_id] if entry.dataset_id is not None else []


def verify_history(
    entries: list[StoredEntry],
    datasets: list[StoredDataset],
    uses: list[StoredTenantUse] = (),
    *,
    key: bytes | None = None,
    reservations: list[StoredReservation] = (),
    commits: list[StoredCommit] = (),
    tenants: list[StoredTenant] = (),
    head: SignedHead | None = None,
) -> Verification:
    """Check the hash chain of every entry under the history `key`, then replay each dataset's, block's and
    tenant use's history, and every reservation, commit and tenant, against the tables' rows.

    `datasets` holds the blocks too (their `block_of` names the dataset
    they belong to); `uses` each tenant's tally and quota on a budget.
    With `head` (a head signed earlier), also check that the history still
    extends it: the one check that sees a tail cut together with the rows
    it changed.
    """
    names = {dataset.dataset_id: dataset.name for dataset in datasets}
    findings = chain_findings(entries, names, key)
    if head is not None:
        findings += head_findings(key, head, entries)
    block_ids = {(row.block_of, row.block): row.dataset_id for row in datasets if row.block_of is not None}
    by_budget: dict[int, list[StoredEntry]] = {}
    for entry in entries:
        for budget_id in _budgets_of(entry, block_ids):
            by_budget.setdefault(budget_id, []).append(entry)
    for dataset in datasets:
        findings += replay_findings(dataset, [entry for entry in by_budget.get(dataset.dataset_id, ())
                                              if entry.action != "set_quota"])
    for budget_id in sorted(set(by_budget) - set(names)):
        findings.append(Finding(by_budget[budget_id][0].entry_id, None, "it is about a dataset or block that has no "
                                                                        "row (the row was removed)"))
    findings += queue_findings(entries, names)
    findings += unit_findings(entries, datasets)
    parent = {row.dataset_id: row.block_of for row in datasets}
    for use in uses:
        findings += use_findings(use, names.get(use.budget_id, str(use.budget_id)), by_budget.get(use.budget_id, []),
                                 by_budget.get(parent.get(use.budget_id), []))
    try:
        findings += job_findings(entries, reservations, commits)
    except (KeyError, TypeError, ValueError, EventError) as error:
        findings.append(Finding(None, None, f"the history's jobs cannot be replayed ({type(error).__name__}: {error})",
                                row="reservations"))
    findings += tenant_findings(entries, tenants)
    return Verification(len(entries), len(datasets), entries[-1].entry_hash if entries else "", tuple(findings))
