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

from accounting.ledger.core import DatasetStatus

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


def rpc_latency_histogram(registry: CollectorRegistry) -> Histogram:
    """The histogram of RPC durations in seconds, by method and gRPC status code, registered in `registry`."""
    return Histogram(RPC_SECONDS, "Time the ledger took to answer an RPC.", ["method", "code"], registry=registry)


def dataset_metrics(statuses: Iterable[DatasetStatus]) -> list[Metric]:
    """The gauges of every dataset in `statuses`, labelled by tenant and dataset (its bare name)."""
    statuses = list(statuses)
    families = []
    for name, documentation, figure in DATASET_GAUGES:
        family = GaugeMetricFamily(name, documentation, labels=["tenant", "dataset"])
        for status in statuses:
            family.add_metric(_labels(status), figure(status))
        families.append(family)
    jobs = GaugeMetricFamily(
        "dpfleet_ledger_jobs", "Reservations on the dataset: active ones hold budget.",
        labels=["tenant", "dataset", "state"],
    )
    for status in statuses:
        jobs.add_metric([*_labels(status), "active"], len(status.jobs))
        jobs.add_metric([*_labels(status), "released"], status.released_jobs)
    return [*families, jobs]


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
