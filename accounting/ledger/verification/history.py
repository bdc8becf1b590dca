"""`verify`: the whole history's chain re-hashed, its head checked, and every replay extended from the last
verified entry (or from the start) and compared with the tables."""

from __future__ import annotations

import json
from typing import Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from accounting.ledger.verification.chain import SignedHead, chain_findings, head_findings
from accounting.ledger.verification.findings import Finding, Verification
from accounting.ledger.records import JobCharge
from accounting.ledger.verification.replay import JOB_ACTIONS, BudgetReplay, ChargeReplay
from accounting.ledger.verification.rows import (
    StoredAdminToken,
    StoredCommit,
    StoredDataset,
    StoredEntry,
    StoredPlan,
    StoredPlanJob,
    StoredReservation,
    StoredTenant,
    StoredTenantUse,
)
from accounting.ledger.verification.tables import JobReplay, QueueReplay, TenantReplay
from accounting.ledger.verification.units import UnitReplay
from accounting.ledger.verification.verified import SEALED_SINCE_VERSION, VerifiedState, verified_state_findings


def _budgets_of(entry: StoredEntry, block_ids: dict[tuple[int, str], int]) -> list[int]:
    """The budgets (dataset or block rows) an entry is about: a job's entries name the blocks it is charged to."""
    if entry.action in JOB_ACTIONS:
        blocks = json.loads(entry.details_json).get("blocks") or ()
        if blocks:
            return [block_ids.get((entry.dataset_id, block), -1) for block in blocks]
    return [entry.dataset_id] if entry.dataset_id is not None else []


def job_charges(
    entries: Sequence[StoredEntry], dataset: StoredDataset, blocks: Sequence[StoredDataset] = (),
) -> dict[str, tuple[JobCharge, ...]]:
    """What each job on `dataset` took from each budget it is charged to (JobCharge, one per budget in the
    order of its blocks, or one for the dataset itself), by reservation id.

    `entries` are the history entries of the dataset and of its `blocks`
    (their rows), oldest first: every tenant's, from its creation, as
    `verify` replays them.
    """
    replays = {budget.dataset_id: ChargeReplay(dataset.name, budget.block) for budget in (dataset, *blocks)}
    block_ids = {(dataset.dataset_id, block.block): block.dataset_id for block in blocks}
    order: dict[str, list[int]] = {}
    for entry in entries:
        if entry.action == "set_quota":  # a tenant's quota, not the budget's own
            continue
        budget_ids = [budget_id for budget_id in _budgets_of(entry, block_ids) if budget_id in replays]
        for budget_id in budget_ids:
            replays[budget_id].replay(entry)
        if entry.action == "reserve":
            order[json.loads(entry.details_json)["reservation_id"]] = budget_ids
    return {
        reservation_id: tuple(replays[budget_id].charges[reservation_id] for budget_id in budget_ids
                              if reservation_id in replays[budget_id].charges)
        for reservation_id, budget_ids in order.items()
    }


class HistoryReplay:
    """Every replay `verify` runs, as state: each budget's, each tenant use's, the queues', the privacy units',
    the jobs' and the tenants'.

    `extend` applies history entries in order; `findings` compares the
    result with the tables. Extending by the entries after a verified one
    gives the state that replaying every entry from the start gives, so
    `verify` keeps it (VerifiedState) and replays only what is new.
    """

    def __init__(self) -> None:
        self.budgets: dict[int, BudgetReplay] = {}
        self.uses: dict[tuple[str, int], BudgetReplay] = {}
        # Each budget an entry was about, and the first such entry: a budget without a row is a finding.
        self.first_entry: dict[int, int] = {}
        self.queues = QueueReplay()
        self.units = UnitReplay()
        self.jobs = JobReplay()
        self.tenants = TenantReplay()

    def extend(self, entries: Sequence[StoredEntry], datasets: list[StoredDataset]) -> None:
        """Apply `entries`, oldest first, after those applied before."""
        rows = {row.dataset_id: row for row in datasets}
        names = {row.dataset_id: row.name for row in datasets}
        block_ids = {(row.block_of, row.block): row.dataset_id for row in datasets if row.block_of is not None}
        blocks_of: dict[int, list[int]] = {}
        for row in datasets:
            if row.block_of is not None:
                blocks_of.setdefault(row.block_of, []).append(row.dataset_id)
        for entry in entries:
            budget_ids = _budgets_of(entry, block_ids)
            for budget_id in budget_ids:
                self.first_entry.setdefault(budget_id, entry.entry_id)
                if budget_id in rows and entry.action != "set_quota":
                    if budget_id not in self.budgets:
                        self.budgets[budget_id] = BudgetReplay.of_budget(rows[budget_id])
                    self.budgets[budget_id].replay(entry)
            if entry.tenant is not None and (entry.action in JOB_ACTIONS or entry.action == "set_quota"):
                for budget_id in budget_ids:
                    self._use(entry.tenant, budget_id, names).replay(entry)
                if entry.action == "set_quota":
                    # A tenant's quota on a dataset is the quota of each of its blocks that has none of its own.
                    for block_id in blocks_of.get(entry.dataset_id, ()):
                        self._use(entry.tenant, block_id, names).replay(entry, from_dataset=True)
            self.queues.apply(entry, names)
            self.units.apply(entry, rows, block_ids)
            self.jobs.apply(entry)
            self.tenants.apply(entry)

    def _use(self, tenant: str, budget_id: int, names: dict[int, str]) -> BudgetReplay:
        use = self.uses.get((tenant, budget_id))
        if use is None:
            use = self.uses[(tenant, budget_id)] = BudgetReplay.of_use(names.get(budget_id, str(budget_id)), tenant)
        return use

    def findings(
        self,
        datasets: list[StoredDataset],
        uses: Sequence[StoredTenantUse],
        reservations: Sequence[StoredReservation],
        commits: Sequence[StoredCommit],
        tenants: Sequence[StoredTenant],
        admin_tokens: Sequence[StoredAdminToken] = (),
        plans: Sequence[StoredPlan] = (),
        plan_jobs: Sequence[StoredPlanJob] = (),
    ) -> list[Finding]:
        """What the replays noted, and where the tables' rows differ from what they replay to."""
        names = {dataset.dataset_id: dataset.name for dataset in datasets}
        findings = []
        for dataset in datasets:
            replay = self.budgets.get(dataset.dataset_id) or BudgetReplay.of_budget(dataset)
            findings += replay.budget_findings(dataset)
            findings += replay.plan_findings(
                dataset, [plan for plan in plans if plan.dataset_id == dataset.dataset_id],
                [job for job in plan_jobs if job.dataset_id == dataset.dataset_id],
            )
        for orphan in sorted({row.dataset_id for row in (*plans, *plan_jobs)} - set(names)):
            findings.append(Finding(None, None, f"plans of dataset id {orphan}, which has no row", row="plan"))
        for budget_id in sorted(set(self.first_entry) - set(names)):
            findings.append(Finding(self.first_entry[budget_id], None, "it is about a dataset or block that has no "
                                                                       "row (the row was removed)"))
        findings += self.queues.findings
        findings += self.units.findings(datasets)
        for use in uses:
            replay = self.uses.get((use.tenant, use.budget_id)) or BudgetReplay.of_use(
                names.get(use.budget_id, str(use.budget_id)), use.tenant
            )
            findings += replay.use_findings(use)
        findings += self.jobs.findings(list(reservations), list(commits))
        findings += self.tenants.findings(list(tenants), list(admin_tokens))
        return findings


def verify_history(
    entries: Sequence[StoredEntry],
    datasets: list[StoredDataset],
    uses: Sequence[StoredTenantUse] = (),
    *,
    key: bytes,
    reservations: Sequence[StoredReservation] = (),
    commits: Sequence[StoredCommit] = (),
    tenants: Sequence[StoredTenant] = (),
    admin_tokens: Sequence[StoredAdminToken] = (),
    schema_version: int | None = None,
    head: SignedHead | None = None,
    head_public_key: Ed25519PublicKey | None = None,
    verified: bytes | None = None,
    full: bool = False,
    plans: Sequence[StoredPlan] = (),
    plan_jobs: Sequence[StoredPlanJob] = (),
) -> tuple[Verification, VerifiedState | None]:
    """Check the hash chain of every entry under the history `key`, then replay each dataset's, block's and
    tenant use's history, and every reservation, commit and tenant, against the tables' rows.

    `datasets` holds the blocks too (their `block_of` names the dataset
    they belong to); `uses` each tenant's tally and quota on a budget.
    With `head` (a head signed earlier), also check that the history still
    extends it: the one check that sees a tail cut together with the rows
    it changed. An Ed25519-signed head is checked with `head_public_key`, an
    HMAC-signed one with `key`.

    `verified` is the state kept by the last verify that found nothing
    (VerifiedState.to_bytes). Unless `full`, the replays start from it and
    apply only the entries after its entry, when its HMAC matches, the
    entry it names still carries the hash it recorded and no entry up to
    there fails the chain; otherwise they start from the first entry. Every
    entry's hash is checked either way, and a state whose HMAC or anchor
    does not match is a finding. Returns what was found, and the state to
    keep when nothing was (None otherwise).

    `schema_version` is the version the ledger's file says it has: from
    SEALED_SINCE_VERSION on every ledger keeps a state, so no state, or one
    of another version, is a finding (a state deleted, or a version number
    changed by hand). `admin_tokens` are compared with the tokens the
    history creates, rotates and revokes, as `tenants` are; `plans` and
    `plan_jobs` with the plans each dataset's history registers and starts.
    """
    names = {dataset.dataset_id: dataset.name for dataset in datasets}
    findings = chain_findings(entries, names, key)
    if head is not None:
        findings += head_findings(key, head, entries, head_public_key)
    start = None
    if verified is not None:
        start, problems = verified_state_findings(key, verified, entries)
        findings += problems
    elif schema_version is not None and schema_version >= SEALED_SINCE_VERSION:
        findings.append(Finding(None, None, f"there is none, though every ledger of schema version "
                                            f"{SEALED_SINCE_VERSION} or later keeps one: it was deleted",
                                row="verified state"))
    if start is not None and schema_version is not None and start.schema_version != schema_version:
        findings.append(Finding(None, None, f"it was kept at schema version {start.schema_version}, but the file "
                                            f"says {schema_version}: the version number was changed by hand",
                                row="verified state"))
    if start is not None and start.replay is not None and not full and not any(
        finding.entry_id is not None and finding.entry_id <= start.last_entry_id for finding in findings
    ):
        replay, replayed = start.replay, entries[start.entries:]
    else:
        replay, replayed = HistoryReplay(), entries
    replay.extend(replayed, datasets)
    findings += replay.findings(datasets, uses, reservations, commits, tenants, admin_tokens, plans, plan_jobs)
    head_hash = entries[-1].entry_hash if entries else ""
    verification = Verification(len(entries), len(datasets), head_hash, tuple(findings), len(replayed))
    if findings or not entries:
        return verification, None
    return verification, VerifiedState(len(entries), entries[-1].entry_id, head_hash, schema_version or 0, replay)
