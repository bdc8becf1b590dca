"""The queue of jobs waiting for budget: adding a job, and serving a dataset's queue by its scheduling policy.

Each budget a waiting job asks for (the dataset's own, or each block it
names) is one block of the policy (accounting.ledger.scheduling), unlocked
from its own creation and by the jobs that arrived on it.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
from datetime import datetime
from typing import NamedTuple

from accounting.events import Composition
from accounting.ledger.admission import RdpTally
from accounting.ledger.callers import QUEUE_ADMISSION, QUEUE_TIMEOUT, Caller
from accounting.ledger.databases import Connection
from accounting.ledger.errors import BudgetExceeded, FailedPrecondition
from accounting.ledger.records import QueuedJob
from accounting.ledger.scheduling import BlockBudget, Decision, QueuedDemand, SchedulingPolicy, schedule
from accounting.ledger.store.admission import (
    JobRequest,
    admission_checks,
    budget_rows,
    hold,
    refuse_unless_admitted,
)
from accounting.ledger.store.clock import expiry, now
from accounting.ledger.store.datasets import DatasetRow
from accounting.ledger.store.queued_jobs import WaitingRow
from accounting.ledger.store.tables import Tables
from accounting.ledger.validation import TIMED_OUT


def same_job_queued(
    tables: Tables, connection: Connection, caller: Caller, reference: str, dataset: DatasetRow, job_id: str,
    planned: Composition,
) -> QueuedJob | None:
    """The entry of `job_id` that waits, or was admitted and holds its reservation, when it queued the same plan
    (a retried enqueue); None when there is none. Another plan is refused."""
    earlier = tables.queue.pending_of_job(connection, dataset.dataset_id, job_id)
    if earlier is None:
        return None
    queued = earlier.queued_job(caller)
    if queued.planned != planned:
        raise FailedPrecondition(
            f"job {job_id!r} is already {queued.state} on dataset {reference!r} as {queued.queue_id} with "
            "another plan; cancel or release it first, or use another job id"
        )
    return queued


def queue_job(
    tables: Tables, connection: Connection, caller: Caller, reference: str, dataset: DatasetRow, job: JobRequest,
    priority: int, max_wait_seconds: float | None, conversion: dict,
) -> str:
    """Add a job to the dataset's queue, unless it holds a reservation or could never fit; its queue id."""
    if tables.reservations.active_of_job(connection, dataset.dataset_id, job.tenant, job.job_id) is not None:
        raise FailedPrecondition(
            f"job {job.job_id!r} already holds a reservation on dataset {reference!r}; release it first or use "
            "another job id"
        )
    budgets = budget_rows(tables, connection, dataset, job.blocks, reference, new_job=True)
    # Committed steps are never freed: a plan that does not fit beside them would wait forever.
    checks, quota_checks = admission_checks(
        tables, connection, job.tenant, dataset, budgets, job.tally, reference, committed=True
    )
    refuse_unless_admitted([*checks, *quota_checks], reference)
    queue_id = f"q-{secrets.token_hex(8)}"
    deadline = expiry(max_wait_seconds)
    tables.queue.insert(
        connection, queue_id, dataset.dataset_id, job.tenant, job.job_id, job.planned, job.blocks, conversion,
        priority, job.lease_seconds, deadline,
    )
    tables.datasets.count_arrival(connection, budgets)
    tables.history.record(
        connection, caller, "enqueue", job.tenant, dataset.dataset_id,
        {"queue_id": queue_id, "job_id": job.job_id, "planned_events": job.planned.to_dict(), "priority": priority,
         "deadline": deadline, "lease_seconds": job.lease_seconds, "blocks": list(job.blocks)},
    )
    return queue_id


class _Candidate(NamedTuple):
    """A waiting job the policy may admit: its demand on each budget, and what admitting it holds."""

    demand: QueuedDemand
    entry: WaitingRow
    job: JobRequest
    conversion: dict
    budgets: list[DatasetRow]


def serve_queue(tables: Tables, connection: Connection, dataset_id: int) -> None:
    """Time out the dataset's overdue waiting jobs, admit those its policy picks, note where the rest stand."""
    started = now()
    waiting = tables.queue.waiting(connection, dataset_id)
    if not waiting:
        return
    dataset = tables.datasets.by_id(connection, dataset_id)
    waiting = _time_out_overdue(tables, connection, dataset, waiting, started)
    if not waiting:
        return
    policy = SchedulingPolicy.from_dict(json.loads(dataset.scheduling))
    reference = f"{dataset.tenant}/{dataset.name}"
    candidates, budget_blocks = _candidates(tables, connection, dataset, policy, reference, waiting, started)
    for decision in schedule(policy, budget_blocks, [candidate.demand for candidate in candidates.values()]):
        _decide(tables, connection, dataset, policy, reference, decision, candidates[decision.job])


def _time_out_overdue(
    tables: Tables, connection: Connection, dataset: DatasetRow, waiting: list[WaitingRow], started: str
) -> list[WaitingRow]:
    """End the wait of the jobs whose deadline passed; those still waiting."""
    for entry in waiting:
        if entry.deadline is not None and entry.deadline <= started:
            tables.queue.end(connection, entry.queue_id, TIMED_OUT, started, "gave up waiting at its deadline")
            tables.history.record(
                connection, QUEUE_TIMEOUT, "queue_timeout", dataset.tenant, dataset.dataset_id,
                {"queue_id": entry.queue_id, "job_id": entry.job_id},
            )
    return [entry for entry in waiting if entry.deadline is None or entry.deadline > started]


def _candidates(
    tables: Tables, connection: Connection, dataset: DatasetRow, policy: SchedulingPolicy, reference: str,
    waiting: list[WaitingRow], started: str,
) -> tuple[dict[str, _Candidate], dict[str, BlockBudget]]:
    """The waiting jobs the policy may admit, by queue id, and the budgets they ask for as the policy's blocks."""
    candidates, budget_blocks = {}, {}
    for arrival, entry in enumerate(waiting):
        blocks = tuple(json.loads(entry.blocks))
        budgets = budget_rows(tables, connection, dataset, blocks, reference)
        if any(budget.block is not None and budget.block_data is None for budget in budgets):
            # Queued before its blocks had to declare their data: like a new job, it is not admitted there.
            undeclared = "a block it names declared no data, so it takes no new job; cancel it"
            if entry.reason != undeclared:
                tables.queue.set_reason(connection, entry.queue_id, undeclared)
            continue
        plan = Composition.from_json(entry.planned_events)
        tally = RdpTally.of(plan)
        demand = {}
        for budget in budgets:
            name = budget.block if budget.block is not None else dataset.name
            if name not in budget_blocks:
                budget_blocks[name] = _block_budget(name, budget, policy, started)
            demand[name] = budget.rule().order_divergences(tally)
        candidates[entry.queue_id] = _Candidate(
            QueuedDemand(entry.queue_id, demand, float(arrival), entry.priority), entry,
            JobRequest(entry.tenant, entry.job_id, blocks, plan, tally, entry.lease_seconds),
            json.loads(entry.conversion), budgets,
        )
    return candidates, budget_blocks


def _block_budget(name: str, budget: DatasetRow, policy: SchedulingPolicy, started: str) -> BlockBudget:
    """A budget as the policy sees it: its capacity, what it holds, and how much of it is unlocked by now."""
    rule = budget.rule()
    age = datetime.fromisoformat(started) - datetime.fromisoformat(budget.created_at)
    return BlockBudget(
        name, rule.capacities(budget.budget_epsilon), rule.order_divergences(RdpTally.from_json(budget.held_rdp)),
        policy.unlocked_fraction(budget.arrived_jobs, age.total_seconds()),
    )


def _decide(
    tables: Tables, connection: Connection, dataset: DatasetRow, policy: SchedulingPolicy, reference: str,
    decision: Decision, candidate: _Candidate,
) -> None:
    """Admit a job the policy picked (holding its reservation), or note where it stands and why."""
    job = candidate.job
    holding = (
        tables.reservations.active_of_job(connection, dataset.dataset_id, job.tenant, job.job_id)
        if decision.admitted else None
    )
    if holding is not None:
        # The same job id reserved directly while it waited: one active reservation per job id.
        decision = replace(decision, admitted=False,
                           reason=f"job id already holds reservation {holding.reservation_id}; cancel this or "
                                  "release that")
    if decision.admitted:
        try:
            reservation_id = hold(
                tables, connection, QUEUE_ADMISSION, reference, dataset, candidate.budgets, job,
                {**candidate.conversion, "queue_id": decision.job, "policy": policy.name},
            )
        except BudgetExceeded:
            # The policy's float arithmetic let it through at the very edge, or a tenant's quota refused it.
            decision = replace(decision, admitted=False,
                               reason="at the edge of the budget or of the tenant's quota; waits for more")
        else:
            tables.queue.admit(connection, decision.job, reservation_id, f"admitted by {policy.name}")
            return
    if (decision.position, decision.reason) != (candidate.entry.position, candidate.entry.reason):
        tables.queue.note(connection, decision.job, decision.position, decision.reason)
