"""Prometheus metrics of a ledger server: each dataset's budget figures and the latency of every RPC.

The dataset gauges are read at scrape time from the statuses the scraper's
token may see (an admin: every tenant's), so they are never stale and need
no bookkeeping on the write path. Epsilons are at each dataset's own δ;
spent is the filter's figure, so spent + reserved + remaining = budget, as
`dpfleet ledger status` shows.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from accounting.ledger.records import BlockStatus, DatasetStatus, QuotaStatus

RPC_SECONDS = "dpfleet_ledger_rpc_duration_seconds"

# name, help, the figure of a status
DATASET_GAUGES: tuple[tuple[str, str, Callable[[DatasetStatus], float]], ...] = (
    ("dpfleet_ledger_budget_epsilon", "The dataset's budget ε at its δ.", lambda status: status.budget_epsilon),
    ("dpfleet_ledger_delta", "The dataset's budget δ.", lambda status: status.delta),
    (
        "dpfleet_ledger_spent_epsilon",
        "ε the RDP filter counts against the committed steps (spent + reserved + remaining = budget).",
        lambda status: status.spent_epsilon_filter,
    ),
    (
        "dpfleet_ledger_reserved_epsilon",
        "ε the active reservations' unrun steps add to spent.",
        lambda status: status.reserved_epsilon,
    ),
    (
        "dpfleet_ledger_remaining_epsilon",
        "ε left for new reservations: the budget less spent and reserved.",
        lambda status: status.remaining_epsilon,
    ),
)


# name, help, the figure of a block's status (labels: the dataset's tenant, the dataset, the block)
BLOCK_GAUGES: tuple[tuple[str, str, Callable[[BlockStatus], float]], ...] = (
    ("dpfleet_ledger_block_budget_epsilon", "The block's budget ε at its δ.", lambda block: block.budget_epsilon),
    ("dpfleet_ledger_block_spent_epsilon", "ε the block's RDP filter counts against its committed steps.",
     lambda block: block.spent_epsilon_filter),
    ("dpfleet_ledger_block_reserved_epsilon", "ε the active reservations on the block add to spent.",
     lambda block: block.reserved_epsilon),
    ("dpfleet_ledger_block_remaining_epsilon", "ε the block has left for new reservations.",
     lambda block: block.remaining_epsilon),
)

# name, help, the figure of a quota (labels: the dataset's tenant, the dataset, the block or "", the quota's tenant)
QUOTA_GAUGES: tuple[tuple[str, str, Callable[[QuotaStatus], float]], ...] = (
    ("dpfleet_ledger_quota_epsilon", "A tenant's quota ε on the dataset or a block.", lambda quota: quota.quota_epsilon),
    ("dpfleet_ledger_quota_spent_epsilon", "ε the quota's filter counts against the tenant's committed steps.",
     lambda quota: quota.spent_epsilon_filter),
    ("dpfleet_ledger_quota_reserved_epsilon", "ε the tenant's active reservations add to its quota's spent.",
     lambda quota: quota.reserved_epsilon),
    ("dpfleet_ledger_quota_remaining_epsilon", "ε the tenant has left under its quota.",
     lambda quota: quota.remaining_epsilon),
)


def rpc_latency_histogram(registry: CollectorRegistry) -> Histogram:
    """The histogram of RPC durations in seconds, by method and gRPC status code, registered in `registry`."""
    return Histogram(RPC_SECONDS, "Time the ledger took to answer an RPC.", ["method", "code"], registry=registry)


def dataset_metrics(statuses: Iterable[DatasetStatus]) -> list[Metric]:
    """The gauges of every dataset in `statuses`, labelled by tenant and dataset (its bare name), and of its blocks,
    quotas and jobs (active, released and queued)."""
    statuses = list(statuses)
    jobs = GaugeMetricFamily(
        "dpfleet_ledger_jobs", "Reservations on the dataset: active ones hold budget.",
        labels=["tenant", "dataset", "state"],
    )
    for status in statuses:
        jobs.add_metric([*_labels(status), "active"], len(status.jobs))
        jobs.add_metric([*_labels(status), "released"], status.released_jobs)
        jobs.add_metric([*_labels(status), "queued"], status.queued_jobs)
    return [
        *_gauge_families(DATASET_GAUGES, ["tenant", "dataset"],
                         [(_labels(status), status) for status in statuses]),
        *_gauge_families(BLOCK_GAUGES, ["tenant", "dataset", "block"],
                         [([*_labels(status), block.name], block) for status in statuses for block in status.blocks]),
        *_gauge_families(QUOTA_GAUGES, ["tenant", "dataset", "block", "quota_tenant"],
                         [([*_labels(status), quota.block or "", quota.tenant], quota)
                          for status in statuses for quota in status.quotas]),
        jobs,
    ]


def _gauge_families(gauges: tuple, labels: list[str], labelled: list[tuple[list[str], object]]) -> list[Metric]:
    """One gauge family per (name, help, figure) of `gauges`, with a sample per (label values, record) of `labelled`."""
    families = []
    for name, documentation, figure in gauges:
        family = GaugeMetricFamily(name, documentation, labels=labels)
        for values, record in labelled:
            family.add_metric(values, figure(record))
        families.append(family)
    return families


def _labels(status: DatasetStatus) -> list[str]:
    return [status.tenant, status.name.removeprefix(f"{status.tenant}/")]


class _Collected:
    """Metric families ready to write, in the shape `generate_latest` reads a registry in."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def exposition(statuses: Iterable[DatasetStatus], server_registry: CollectorRegistry | None) -> bytes:
    """The Prometheus text of the datasets' gauges, then of `server_registry` (the RPC latencies) when given."""
    text = generate_latest(_Collected(dataset_metrics(statuses)))
    return text + generate_latest(server_registry) if server_registry is not None else text
