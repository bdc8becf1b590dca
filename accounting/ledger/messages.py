"""The ledger's wire format: records (core) to protobuf messages and back, and error codes.

Events travel as the versioned Composition JSON (see accounting/ledger.proto).
"""

from __future__ import annotations

import json

import grpc

from accounting.events import Composition
from accounting.ledger import ledger_pb2 as pb
from accounting.ledger.admission import AdmissionRule, BudgetCheck, FitReport
from accounting.ledger.errors import (
    AlreadyExists,
    BudgetExceeded,
    FailedPrecondition,
    InvalidArgument,
    LedgerError,
    LedgerUnavailable,
    NotFound,
    PermissionDenied,
    RateLimited,
    Unauthenticated,
)
from accounting.ledger.records import (
    BlockStatus,
    CommitResult,
    DatasetStatus,
    HistoryEntry,
    JobCharge,
    PlanStatus,
    QueuedJob,
    QuotaStatus,
    Reservation,
    TenantCreated,
)
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.validation import ACTIVE, EXAMPLE, RELEASED, check_state

STATUS_CODES: dict[type[LedgerError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    BudgetExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RateLimited: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    LedgerUnavailable: grpc.StatusCode.UNAVAILABLE,
}

# Trailing metadata of a RESOURCE_EXHAUSTED refusal for budget.
REMAINING_EPSILON_KEY = "dpfleet-remaining-epsilon"
NEEDED_EPSILON_KEY = "dpfleet-needed-epsilon"
DELTA_KEY = "dpfleet-delta"
DATASET_KEY = "dpfleet-dataset"
BUDGET_KEY = "dpfleet-budget"
# Trailing metadata of a RESOURCE_EXHAUSTED refusal for rate: seconds until the request would be let through.
RETRY_AFTER_KEY = "dpfleet-retry-after-seconds"

_STATE_TO_PROTO = {None: pb.JOB_STATE_UNSPECIFIED, ACTIVE: pb.JOB_STATE_ACTIVE, RELEASED: pb.JOB_STATE_RELEASED}
_STATE_FROM_PROTO = {value: state for state, value in _STATE_TO_PROTO.items()}


def state_to_proto(state: str | None) -> int:
    """A reservation state ('active', 'released' or None for any) as a JobState value."""
    return _STATE_TO_PROTO[check_state(state)]


def state_from_proto(value: int) -> str | None:
    """A JobState value as a reservation state; an unknown value is InvalidArgument."""
    try:
        return _STATE_FROM_PROTO[value]
    except KeyError:
        raise InvalidArgument(
            f"job state {value} is not a JobState; use 0 (any), 1 (active) or 2 (released)"
        ) from None


def tenant_to_proto(created: TenantCreated) -> pb.CreateTenantReply:
    """TenantCreated as its reply."""
    return pb.CreateTenantReply(tenant=created.tenant or "", token=created.token)


def tenant_from_proto(message: pb.CreateTenantReply) -> TenantCreated:
    """Inverse of tenant_to_proto."""
    return TenantCreated(message.tenant or None, message.token)


def reservation_to_proto(reservation: Reservation) -> pb.Reservation:
    """A Reservation as its message."""
    return pb.Reservation(
        reservation_id=reservation.reservation_id,
        dataset=reservation.dataset,
        job_id=reservation.job_id,
        state=state_to_proto(reservation.state),
        planned_events_json=reservation.planned.to_json(),
        committed_steps=reservation.committed_steps,
        created_at=reservation.created_at,
        released_at=reservation.released_at or "",
        lease_seconds=reservation.lease_seconds or 0.0,
        expires_at=reservation.expires_at or "",
        lease_expired=reservation.lease_expired,
        blocks=reservation.blocks,
        charges=None if reservation.charges is None else pb.JobCharges(budgets=[
            pb.JobCharge(block=charge.block or "", remaining_before_epsilon=charge.remaining_before_epsilon,
                         admitted_epsilon=charge.admitted_epsilon, charged_epsilon=charge.charged_epsilon)
            for charge in reservation.charges
        ]),
        plan=reservation.plan or "",
    )


def reservation_from_proto(message: pb.Reservation) -> Reservation:
    """Inverse of reservation_to_proto."""
    return Reservation(
        reservation_id=message.reservation_id,
        dataset=message.dataset,
        job_id=message.job_id,
        state=state_from_proto(message.state),
        planned=Composition.from_json(message.planned_events_json),
        committed_steps=message.committed_steps,
        created_at=message.created_at,
        released_at=message.released_at or None,
        lease_seconds=message.lease_seconds or None,
        expires_at=message.expires_at or None,
        lease_expired=message.lease_expired,
        blocks=tuple(message.blocks),
        charges=tuple(
            JobCharge(charge.block or None, charge.remaining_before_epsilon, charge.admitted_epsilon,
                      charge.charged_epsilon)
            for charge in message.charges.budgets
        ) if message.HasField("charges") else None,
        plan=message.plan or None,
    )


def plan_to_proto(plan: PlanStatus) -> pb.Plan:
    """A PlanStatus as its message."""
    return pb.Plan(
        name=plan.name, dataset=plan.dataset, tenant=plan.tenant, jobs_json=[job.to_json() for job in plan.jobs],
        epsilon=plan.epsilon, delta=plan.delta, started_jobs=plan.started_jobs, created_at=plan.created_at,
    )


def plan_from_proto(message: pb.Plan) -> PlanStatus:
    """Inverse of plan_to_proto."""
    return PlanStatus(
        name=message.name, dataset=message.dataset, tenant=message.tenant,
        jobs=tuple(Composition.from_json(job) for job in message.jobs_json), epsilon=message.epsilon,
        delta=message.delta, started_jobs=message.started_jobs, created_at=message.created_at,
    )


def _rule_to_proto(rule: AdmissionRule) -> pb.AdmissionRule:
    return pb.AdmissionRule(rule=rule.name, orders=rule.orders, delta_per_order=rule.delta_per_order,
                            plan_epsilon=rule.plan_epsilon, plan_delta=rule.plan_delta)


def _rule_from_proto(message: pb.AdmissionRule, delta: float) -> AdmissionRule:
    return AdmissionRule(tuple(message.orders), delta, message.rule, message.plan_epsilon, message.plan_delta)


def _budget_to_proto(status: BlockStatus | DatasetStatus) -> dict:
    """The fields a dataset's and a block's status messages share."""
    return {
        "budget_epsilon": status.budget_epsilon,
        "delta": status.delta,
        "admission": _rule_to_proto(status.admission),
        "spent_epsilon": status.spent_epsilon,
        "spent_epsilon_rdp": status.spent_epsilon_rdp,
        "spent_epsilon_filter": status.spent_epsilon_filter,
        "reserved_epsilon": status.reserved_epsilon,
        "remaining_epsilon": status.remaining_epsilon,
        "spent_epsilon_accountant": status.spent_epsilon_accountant,
    }


def _budget_from_proto(message: pb.BlockStatus | pb.DatasetStatus) -> dict:
    """Inverse of _budget_to_proto."""
    return {
        "budget_epsilon": message.budget_epsilon,
        "delta": message.delta,
        "admission": _rule_from_proto(message.admission, message.delta),
        "spent_epsilon": message.spent_epsilon,
        "spent_epsilon_rdp": message.spent_epsilon_rdp,
        "spent_epsilon_filter": message.spent_epsilon_filter,
        "reserved_epsilon": message.reserved_epsilon,
        "remaining_epsilon": message.remaining_epsilon,
        "spent_epsilon_accountant": message.spent_epsilon_accountant or "pld",
    }


def block_to_proto(block: BlockStatus) -> pb.BlockStatus:
    """A BlockStatus as its message."""
    return pb.BlockStatus(
        name=block.name, **_budget_to_proto(block),
        data=json.dumps(block.data, sort_keys=True) if block.data is not None else "",
    )


def block_from_proto(message: pb.BlockStatus) -> BlockStatus:
    """Inverse of block_to_proto."""
    return BlockStatus(
        name=message.name, **_budget_from_proto(message), data=json.loads(message.data) if message.data else None
    )


def quota_to_proto(quota: QuotaStatus) -> pb.QuotaStatus:
    """A QuotaStatus as its message."""
    return pb.QuotaStatus(
        tenant=quota.tenant,
        block=quota.block or "",
        quota_epsilon=quota.quota_epsilon,
        admission=_rule_to_proto(quota.admission),
        spent_epsilon_filter=quota.spent_epsilon_filter,
        reserved_epsilon=quota.reserved_epsilon,
        remaining_epsilon=quota.remaining_epsilon,
        inherited=quota.inherited,
        delta=quota.admission.delta,
    )


def quota_from_proto(message: pb.QuotaStatus) -> QuotaStatus:
    """Inverse of quota_to_proto."""
    return QuotaStatus(
        tenant=message.tenant,
        block=message.block or None,
        quota_epsilon=message.quota_epsilon,
        admission=_rule_from_proto(message.admission, message.delta),
        spent_epsilon_filter=message.spent_epsilon_filter,
        reserved_epsilon=message.reserved_epsilon,
        remaining_epsilon=message.remaining_epsilon,
        inherited=message.inherited,
    )


def fit_to_proto(report: FitReport) -> pb.FitsReply:
    """A FitReport as its reply."""
    return pb.FitsReply(
        dataset=report.dataset,
        blocks=report.blocks,
        fits=report.fits,
        checks=[
            pb.BudgetCheck(
                budget=check.budget,
                budget_epsilon=check.budget_epsilon,
                delta=check.delta,
                held_epsilon=check.held_epsilon,
                held_after_epsilon=check.held_after_epsilon,
                needed_epsilon=check.needed_epsilon,
                remaining_epsilon=check.remaining_epsilon,
                remaining_after_epsilon=check.remaining_after_epsilon,
                fits=check.fits,
            )
            for check in report.checks
        ],
    )


def fit_from_proto(message: pb.FitsReply) -> FitReport:
    """Inverse of fit_to_proto."""
    return FitReport(
        dataset=message.dataset,
        blocks=tuple(message.blocks),
        checks=tuple(
            BudgetCheck(
                budget=check.budget,
                budget_epsilon=check.budget_epsilon,
                delta=check.delta,
                held_epsilon=check.held_epsilon,
                held_after_epsilon=check.held_after_epsilon,
                needed_epsilon=check.needed_epsilon,
                remaining_epsilon=check.remaining_epsilon,
                remaining_after_epsilon=check.remaining_after_epsilon,
                fits=check.fits,
            )
            for check in message.checks
        ),
    )


def status_to_proto(status: DatasetStatus) -> pb.DatasetStatus:
    """A DatasetStatus as its message."""
    return pb.DatasetStatus(
        name=status.name,
        tenant=status.tenant,
        **_budget_to_proto(status),
        jobs=[reservation_to_proto(job) for job in status.jobs],
        released_jobs=status.released_jobs,
        blocks=[block_to_proto(block) for block in status.blocks],
        quotas=[quota_to_proto(quota) for quota in status.quotas],
        privacy_unit=status.privacy_unit,
        scheduling=scheduling_to_proto(status.scheduling),
        queued_jobs=status.queued_jobs,
        plans=status.plans,
        plans_epsilon=status.plans_epsilon,
        plans_delta=status.plans_delta,
    )


def status_from_proto(message: pb.DatasetStatus) -> DatasetStatus:
    """Inverse of status_to_proto."""
    return DatasetStatus(
        name=message.name,
        tenant=message.tenant,
        **_budget_from_proto(message),
        jobs=tuple(reservation_from_proto(job) for job in message.jobs),
        released_jobs=message.released_jobs,
        blocks=tuple(block_from_proto(block) for block in message.blocks),
        quotas=tuple(quota_from_proto(quota) for quota in message.quotas),
        privacy_unit=message.privacy_unit or EXAMPLE,
        scheduling=SchedulingPolicy.from_dict(
            scheduling_from_proto(message.scheduling) or SchedulingPolicy().to_dict()
        ),
        queued_jobs=message.queued_jobs,
        plans=message.plans,
        plans_epsilon=message.plans_epsilon,
        plans_delta=message.plans_delta,
    )


def commit_to_proto(result: CommitResult) -> pb.CommitReply:
    """A CommitResult as its reply."""
    return pb.CommitReply(
        reservation_id=result.reservation_id,
        sequence=result.sequence,
        steps=result.steps,
        committed_steps=result.committed_steps,
        planned_steps=result.planned_steps,
    )


def commit_from_proto(message: pb.CommitReply) -> CommitResult:
    """Inverse of commit_to_proto."""
    return CommitResult(
        reservation_id=message.reservation_id,
        sequence=message.sequence,
        steps=message.steps,
        committed_steps=message.committed_steps,
        planned_steps=message.planned_steps,
    )


def history_to_proto(entry: HistoryEntry) -> pb.HistoryEntry:
    """A HistoryEntry as its message."""
    return pb.HistoryEntry(
        entry_id=entry.entry_id,
        at=entry.at,
        actor=entry.actor,
        action=entry.action,
        dataset=entry.dataset or "",
        details_json=json.dumps(entry.details, sort_keys=True),
    )


def history_from_proto(message: pb.HistoryEntry) -> HistoryEntry:
    """Inverse of history_to_proto."""
    return HistoryEntry(
        entry_id=message.entry_id,
        at=message.at,
        actor=message.actor,
        action=message.action,
        dataset=message.dataset or None,
        details=json.loads(message.details_json),
    )


def scheduling_to_proto(policy: SchedulingPolicy | None) -> pb.Scheduling | None:
    """A SchedulingPolicy as its message (None: unset, the server's default)."""
    if policy is None:
        return None
    return pb.Scheduling(
        policy=policy.name, unlock_jobs=policy.unlock_jobs or 0, unlock_seconds=policy.unlock_seconds or 0.0
    )


def scheduling_from_proto(message: pb.Scheduling) -> dict | None:
    """Inverse of scheduling_to_proto, as the dict the ledger checks (None when the policy is unset)."""
    if not message.policy:
        return None
    return {"policy": message.policy, "unlock_jobs": message.unlock_jobs or None,
            "unlock_seconds": message.unlock_seconds or None}


def queued_to_proto(job: QueuedJob) -> pb.QueuedJob:
    """A QueuedJob as its message."""
    return pb.QueuedJob(
        queue_id=job.queue_id,
        dataset=job.dataset,
        job_id=job.job_id,
        state=job.state,
        planned_events_json=job.planned.to_json(),
        priority=job.priority,
        created_at=job.created_at,
        deadline=job.deadline or "",
        position=job.position,
        reason=job.reason,
        reservation_id=job.reservation_id or "",
        ended_at=job.ended_at or "",
        lease_seconds=job.lease_seconds or 0.0,
    )


def queued_from_proto(message: pb.QueuedJob) -> QueuedJob:
    """Inverse of queued_to_proto."""
    return QueuedJob(
        queue_id=message.queue_id,
        dataset=message.dataset,
        job_id=message.job_id,
        state=message.state,
        planned=Composition.from_json(message.planned_events_json),
        priority=message.priority,
        created_at=message.created_at,
        deadline=message.deadline or None,
        position=message.position,
        reason=message.reason,
        reservation_id=message.reservation_id or None,
        ended_at=message.ended_at or None,
        lease_seconds=message.lease_seconds or None,
    )
