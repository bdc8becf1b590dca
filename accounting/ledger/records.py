"""The ledger's named records, shared by the store, the client, the service and the command line."""

from __future__ import annotations

from dataclasses import dataclass, field

from accounting.events import Composition, noise_placement
from accounting.ledger.admission import AdmissionRule, RdpTally, rdp_figures
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.validation import ACTIVE, EXAMPLE


@dataclass(frozen=True)
class TenantCreated:
    """A new token, shown this once and stored only as its digest: a new tenant's, a tenant's rotated one, or
    (tenant None) a rotated admin token."""

    tenant: str | None
    token: str

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {"tenant": self.tenant, "token": self.token}


@dataclass(frozen=True)
class JobCharge:
    """What a job takes from one budget it is charged to (the dataset's, `block` None, or a block's), in that
    budget's filter ε at its δ.

    `remaining_before_epsilon` is the budget's remaining ε just before the
    job's reservation was admitted, and `admitted_epsilon` what the
    reservation took from it: remaining before minus remaining after, which
    holds the RDP-to-(ε, δ) conversion's offset when the budget held nothing
    before. `charged_epsilon` is what the job's commits took from it: each
    commit the rise it made in the filter's ε of the committed steps, in the
    order the ledger charged them, so that the charges of a budget's jobs
    add up to its spent ε (filter).
    """

    block: str | None
    remaining_before_epsilon: float
    admitted_epsilon: float
    charged_epsilon: float

    @property
    def remaining_after_epsilon(self) -> float:
        """The budget's remaining ε just after the job's reservation was admitted."""
        return self.remaining_before_epsilon - self.admitted_epsilon

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "block": self.block,
            "remaining_before_epsilon": self.remaining_before_epsilon,
            "admitted_epsilon": self.admitted_epsilon,
            "remaining_after_epsilon": self.remaining_after_epsilon,
            "charged_epsilon": self.charged_epsilon,
        }


@dataclass(frozen=True)
class Reservation:
    """A job's hold on a dataset: its planned events and how many of their steps are committed.

    With a lease (`lease_seconds`), the hold ends at `expires_at` (UTC, ISO
    8601) unless a commit renews it first; `lease_expired` says the
    reservation was released that way. `blocks` are the dataset's blocks the
    job is charged to, every one of them in full; () for the dataset itself.
    `charges` are what it takes from each of those budgets (JobCharge, in
    the order of `blocks`), where the listing replayed them
    (`list_jobs(charges=True)`); None elsewhere. `plan` names the
    pre-registered plan the job runs in: its steps were paid for when the plan
    was admitted, so its commits take nothing more and its release refunds
    nothing.
    """

    reservation_id: str
    dataset: str
    job_id: str
    state: str
    planned: Composition
    committed_steps: int
    created_at: str
    released_at: str | None = None
    lease_seconds: float | None = None
    expires_at: str | None = None
    lease_expired: bool = False
    blocks: tuple[str, ...] = ()
    charges: tuple[JobCharge, ...] | None = None
    plan: str | None = None

    @property
    def planned_steps(self) -> int:
        """Steps in the plan."""
        return self.planned.steps

    @property
    def noise_placement(self) -> str:
        """Who adds the job's noise, as its planned events record it: "driver", or "silos" (Skellam shares)."""
        return noise_placement(self.planned)

    @property
    def unrun_steps(self) -> int:
        """Planned steps still held: not committed, and the reservation not released."""
        return self.planned.steps - self.committed_steps if self.state == ACTIVE else 0

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "reservation_id": self.reservation_id,
            "dataset": self.dataset,
            "job_id": self.job_id,
            "state": self.state,
            "planned_steps": self.planned_steps,
            "committed_steps": self.committed_steps,
            "unrun_steps": self.unrun_steps,
            "planned_events": self.planned.to_dict(),
            "noise_placement": self.noise_placement,
            "created_at": self.created_at,
            "released_at": self.released_at,
            "lease_seconds": self.lease_seconds,
            "expires_at": self.expires_at,
            "lease_expired": self.lease_expired,
            "blocks": list(self.blocks),
            "charges": None if self.charges is None else [charge.to_dict() for charge in self.charges],
            "plan": self.plan,
        }


@dataclass(frozen=True)
class PlanStatus:
    """A pre-registered plan: its jobs' charged events in order, the (epsilon, delta) its dataset's plan pool was
    charged for all of them when it was admitted, and how many have started.

    Jobs of the plan that never start are not refunded: whether to run them
    may depend on the results of the ones that ran, so a refund would be an
    adaptive choice the plan's guarantee does not cover.
    """

    name: str
    dataset: str
    tenant: str
    jobs: tuple[Composition, ...]
    epsilon: float
    delta: float
    started_jobs: int
    created_at: str

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "name": self.name,
            "dataset": self.dataset,
            "tenant": self.tenant,
            "jobs": [job.to_dict() for job in self.jobs],
            "epsilon": self.epsilon,
            "delta": self.delta,
            "started_jobs": self.started_jobs,
            "unstarted_jobs_not_refunded": len(self.jobs) - self.started_jobs,
            "created_at": self.created_at,
        }


@dataclass(frozen=True)
class QueuedJob:
    """A job waiting for budget on a dataset, or what became of it.

    `state` is one of QUEUE_STATES; once admitted, `reservation_id` is the
    reservation it holds. While queued, `position` (1 = next) and `reason`
    say where it stands under the dataset's policy; `deadline` (UTC, ISO
    8601) is when it gives up waiting, None to wait until admitted or
    cancelled.
    """

    queue_id: str
    dataset: str
    job_id: str
    state: str
    planned: Composition
    priority: int
    created_at: str
    deadline: str | None = None
    position: int = 0
    reason: str = ""
    reservation_id: str | None = None
    ended_at: str | None = None
    lease_seconds: float | None = None

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "queue_id": self.queue_id,
            "dataset": self.dataset,
            "job_id": self.job_id,
            "state": self.state,
            "planned_steps": self.planned.steps,
            "priority": self.priority,
            "created_at": self.created_at,
            "deadline": self.deadline,
            "position": self.position,
            "reason": self.reason,
            "reservation_id": self.reservation_id,
            "ended_at": self.ended_at,
            "lease_seconds": self.lease_seconds,
        }


@dataclass(frozen=True)
class CommitResult:
    """What one commit charged; a retry with the same sequence returns the same result."""

    reservation_id: str
    sequence: int
    steps: int
    committed_steps: int
    planned_steps: int

    @property
    def unrun_steps(self) -> int:
        """Planned steps not committed yet after this commit."""
        return self.planned_steps - self.committed_steps

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "reservation_id": self.reservation_id,
            "sequence": self.sequence,
            "steps": self.steps,
            "committed_steps": self.committed_steps,
            "planned_steps": self.planned_steps,
        }


@dataclass(frozen=True)
class BlockStatus:
    """One block of a dataset: its own (epsilon, delta) budget and filter, and the figures of its tally.

    The figures mean what they mean for a dataset (see DatasetStatus).
    """

    name: str
    budget_epsilon: float
    delta: float
    admission: AdmissionRule
    spent_epsilon: float
    spent_epsilon_rdp: float
    spent_epsilon_filter: float
    reserved_epsilon: float
    remaining_epsilon: float
    spent_epsilon_accountant: str = "pld"
    data: dict | None = None

    def to_dict(self) -> dict:
        """JSON-ready dict; `data` is where its rows are (None: a block added before blocks declared it)."""
        return {"name": self.name, **budget_dict(self), "data": self.data}


def budget_dict(status: "BlockStatus | DatasetStatus") -> dict:
    """The budget and figures a dataset's or a block's status share, as JSON-ready dict entries."""
    return {
        "budget_epsilon": status.budget_epsilon,
        "delta": status.delta,
        "admission": status.admission.to_dict(),
        "spent_epsilon_filter": status.spent_epsilon_filter,
        "spent_epsilon": status.spent_epsilon,
        "spent_epsilon_accountant": status.spent_epsilon_accountant,
        "spent_epsilon_rdp": status.spent_epsilon_rdp,
        "reserved_epsilon": status.reserved_epsilon,
        "remaining_epsilon": status.remaining_epsilon,
    }


@dataclass(frozen=True)
class QuotaStatus:
    """A tenant's quota on a dataset (`block` None) or one of its blocks, and the tenant's use of it.

    The quota is an extra RDP filter at its own orders on the tenant's own
    tally, beside the budget's filter. `quota_epsilon` is at the budget's
    delta; `spent_epsilon_filter` + `reserved_epsilon` + `remaining_epsilon`
    = `quota_epsilon`, in the quota's filter epsilon. `inherited` marks a
    quota set on the dataset that applies to this block.
    """

    tenant: str
    block: str | None
    quota_epsilon: float
    admission: AdmissionRule
    spent_epsilon_filter: float
    reserved_epsilon: float
    remaining_epsilon: float
    inherited: bool = False

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "tenant": self.tenant,
            "block": self.block,
            "quota_epsilon": self.quota_epsilon,
            "admission": self.admission.to_dict(),
            "spent_epsilon_filter": self.spent_epsilon_filter,
            "reserved_epsilon": self.reserved_epsilon,
            "remaining_epsilon": self.remaining_epsilon,
            "inherited": self.inherited,
        }


def quota_status(
    tenant: str, block: str | None, quota_epsilon: float, rule: AdmissionRule, committed: RdpTally,
    held: RdpTally, inherited: bool = False,
) -> QuotaStatus:
    """A tenant's quota figures from the tally of its committed steps and its tally on the budget (filter
    epsilons only)."""
    figures = rdp_figures(quota_epsilon, rule, committed, held)
    return QuotaStatus(
        tenant, block, quota_epsilon, rule, figures.spent_epsilon_filter, figures.reserved_epsilon,
        figures.remaining_epsilon, inherited,
    )


@dataclass(frozen=True)
class DatasetStatus:
    """A dataset's budget and where it went, in epsilon at `delta`.

    `admission` is the rule the dataset admits jobs by; `spent_epsilon_filter`
    what that rule counts against the committed steps, and
    spent_epsilon_filter + reserved_epsilon + remaining_epsilon = budget.
    `spent_epsilon` (PLD) and `spent_epsilon_rdp` are the epsilon of the same
    steps as if every job had been fixed in advance: non-adaptive figures,
    tighter, not what the guarantee rests on.
    `jobs` are the reservations still active (holding budget) that the
    caller may see: a tenant sees only its own;
    `released_jobs` counts the finished ones (dpfleet ledger jobs lists them).
    `blocks` are the dataset's blocks, each with its own budget; `quotas`
    the tenants' quotas on the dataset and its blocks (a tenant sees its own).
    `spent_epsilon_accountant` is "pld", or "rdp" while the PLD figure of
    new commits is computed for a caller that chose not to wait for it, and
    where the PLD is not composed (ledger.caches.pld_is_practical, or its
    composition ran past its deadline): the rigorous RDP bound.
    `privacy_unit` is what one unit of protection is: a row ('example') or a
    person with all its rows ('user'); every epsilon is per that unit.
    `scheduling` is how its queue is served; `queued_jobs` counts the jobs waiting.
    With a plan pool (`admission.plan_epsilon`, `admission.plan_delta`, set
    aside at creation), `budget_epsilon` and `delta` are the filter's part,
    and `plans_epsilon` and `plans_delta` what the `plans` pre-registered
    plans were charged from the pool, by basic composition.
    """

    name: str
    tenant: str
    budget_epsilon: float
    delta: float
    admission: AdmissionRule
    spent_epsilon: float
    spent_epsilon_rdp: float
    spent_epsilon_filter: float
    reserved_epsilon: float
    remaining_epsilon: float
    jobs: tuple[Reservation, ...] = ()
    released_jobs: int = 0
    spent_epsilon_accountant: str = "pld"
    privacy_unit: str = EXAMPLE
    blocks: tuple[BlockStatus, ...] = ()
    quotas: tuple[QuotaStatus, ...] = ()
    scheduling: SchedulingPolicy = SchedulingPolicy()
    queued_jobs: int = 0
    plans: int = 0
    plans_epsilon: float = 0.0
    plans_delta: float = 0.0

    def to_dict(self) -> dict:
        """JSON-ready dict (the `dpfleet ledger status --json` shape)."""
        return {
            "name": self.name,
            "tenant": self.tenant,
            "privacy_unit": self.privacy_unit,
            **budget_dict(self),
            "jobs": [job.to_dict() for job in self.jobs],
            "released_jobs": self.released_jobs,
            "blocks": [block.to_dict() for block in self.blocks],
            "quotas": [quota.to_dict() for quota in self.quotas],
            "scheduling": self.scheduling.to_dict(),
            "queued_jobs": self.queued_jobs,
            **({"plan_pool": {
                "epsilon": self.admission.plan_epsilon, "delta": self.admission.plan_delta, "plans": self.plans,
                "charged_epsilon": self.plans_epsilon, "charged_delta": self.plans_delta,
                "remaining_epsilon": self.admission.plan_epsilon - self.plans_epsilon,
                "remaining_delta": self.admission.plan_delta - self.plans_delta,
            }} if self.admission.has_plan_pool else {}),
        }


@dataclass(frozen=True)
class HistoryEntry:
    """One change to the ledger: when (UTC, ISO 8601), who, what, on which dataset, and the details."""

    entry_id: int
    at: str
    actor: str
    action: str
    dataset: str | None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "entry_id": self.entry_id,
            "at": self.at,
            "actor": self.actor,
            "action": self.action,
            "dataset": self.dataset,
            "details": self.details,
        }
