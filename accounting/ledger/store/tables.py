"""The ledger's repositories, one per table, bundled for the rules that read and write several of them."""

from __future__ import annotations

from dataclasses import dataclass

from accounting.ledger.databases import Database
from accounting.ledger.store.composed import ComposedDistributions
from accounting.ledger.store.datasets import Datasets
from accounting.ledger.store.history import HistoryChain
from accounting.ledger.store.plans import Plans
from accounting.ledger.store.queued_jobs import QueuedJobs
from accounting.ledger.store.reservations import Reservations
from accounting.ledger.store.tenants import Tenants
from accounting.ledger.store.uses import TenantUses


@dataclass(frozen=True)
class Tables:
    """One ledger's repositories: datasets and blocks, tenant uses and quotas, reservations and commits, the
    queue, tenants and tokens, the history it records every change in, the budgets' composed PLDs, and the
    pre-registered plans."""

    datasets: Datasets
    uses: TenantUses
    reservations: Reservations
    queue: QueuedJobs
    tenants: Tenants
    history: HistoryChain
    composed: ComposedDistributions
    plans: Plans

    @classmethod
    def of(cls, database: Database, history: HistoryChain) -> "Tables":
        """The repositories of `database`, recording in `history`."""
        return cls(
            Datasets(database), TenantUses(), Reservations(database), QueuedJobs(), Tenants(database), history,
            ComposedDistributions(database.location, history.key), Plans(),
        )
