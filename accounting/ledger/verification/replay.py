"""A budget's history replayed entry by entry: each departure from the rules, and the burn-down of a dataset."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import Callable

from accounting.events import Composition, EventError, event_of, group_events
from accounting.ledger.admission import (
    AdmissionRule, PoolUse, RdpTally, canonical, fits_budget, plan_epsilon, plan_jobs_json, pool_admits, split_steps,
)
from accounting.ledger.records import HistoryEntry, JobCharge
from accounting.ledger.verification.findings import Finding
from accounting.ledger.verification.rows import (
    StoredDataset, StoredEntry, StoredPlan, StoredPlanJob, StoredTenantUse,
)

# The actions of a job's history entries.
JOB_ACTIONS = ("reserve", "commit", "release", "expire")


def _nothing_recorded(details: dict) -> None:
    return None


def _recorded_for_dataset(details: dict) -> float | None:
    return details.get("held_epsilon_filter", details.get("held_epsilon_rdp"))


def _recorded_for_block(block: str, details: dict) -> float | None:
    return details.get("held_epsilon_filter_by_block", {}).get(block)


class BudgetReplay:
    """A budget's state rebuilt from its history, entry by entry, noting each departure from the rules.

    The budget is a dataset's or a block's (`recorded_held` finds the
    filter epsilon the reserve entry recorded for it), or a tenant's use of
    one (`quota`: its quota, set on the budget itself or on the dataset the
    block belongs to; nothing is checked while none is set). Plain data
    (`recorded_held` a module function or a partial of one), so `verify`
    keeps it, pickled, as the state at its last verified entry.
    """

    def __init__(self, dataset: str, recorded_held: Callable[[dict], float | None] | None = None,
                 quota: bool = False, plan_costs: bool = True) -> None:
        self.dataset = dataset
        # Whether each plan's recorded ε is checked against its jobs' PLD ε (verify's; a listing's replay trusts
        # what verify checks, and computes no PLD).
        self.plan_costs = plan_costs
        self.recorded_held = recorded_held or _nothing_recorded
        self.quota = quota
        self.findings: list[Finding] = []
        self.budget_epsilon: float | None = None
        self.delta: float | None = None
        self.admission: AdmissionRule | None = None
        # A tenant's quota set on the dataset applies to each of its blocks that has none of its own.
        self.dataset_quota: tuple[float, AdmissionRule] | None = None
        self.held = RdpTally.zero()
        # The committed steps per mechanism, and their tally: a commit adds to both, with no pass over every
        # mechanism committed before (a tally is an exact sum).
        self.committed_steps_by_mechanism: dict[tuple[float, float, float], int] = {}
        self.committed_tally = RdpTally.zero()
        self.plans: dict[str, Composition] = {}
        self.committed_steps: dict[str, int] = {}
        # Pre-registered plans: each one's jobs and how many started, what the pool paid for them, and the
        # reservations of their jobs (which hold and commit nothing in the filter).
        self.registered_plans: dict[str, dict] = {}
        self.pool_used = PoolUse()
        self.plan_jobs: dict[str, tuple[str, int]] = {}

    @classmethod
    def of_budget(cls, dataset: StoredDataset) -> "BudgetReplay":
        """The replay of a dataset's or a block's own budget, from nothing."""
        if dataset.block is None:
            return cls(dataset.name, _recorded_for_dataset)
        return cls(dataset.name, functools.partial(_recorded_for_block, dataset.block))

    @classmethod
    def of_use(cls, budget_name: str, tenant: str) -> "BudgetReplay":
        """The replay of a tenant's use of a budget (its quota there), from nothing."""
        return cls(f"{budget_name} (tenant {tenant})", quota=True)

    def replay(self, entry: StoredEntry, from_dataset: bool = False) -> None:
        """Apply one entry; one it cannot apply is a finding."""
        try:
            self.apply(entry, from_dataset)
        except (KeyError, TypeError, ValueError, EventError) as error:
            self.note(entry, f"its details cannot be replayed ({type(error).__name__}: {error})")

    def budget_findings(self, dataset: StoredDataset) -> list[Finding]:
        """What the replay found, and where its budget, rule, tally and committed events differ from the row's."""
        findings = list(self.findings)
        for what, replayed, stored in (
            ("budget ε", self.budget_epsilon, dataset.budget_epsilon),
            ("admission rule", self.admission, dataset.admission),
            ("RDP tally of committed and reserved steps", self.held, dataset.held),
            ("set of committed events", canonical(self.committed), dataset.committed_events),
        ):
            if replayed != stored:
                findings.append(Finding(None, dataset.name, f"the row's {what} is not what its history replays to"))
        return findings

    def plan_findings(self, dataset: StoredDataset, plans: list[StoredPlan], jobs: list[StoredPlanJob]) -> list[Finding]:
        """Where the dataset's rows of plans and of their started jobs differ from what its history replays to."""
        findings = []
        stored = {plan.name: plan for plan in plans}
        for name in sorted(set(stored) | set(self.registered_plans)):
            row, replayed = stored.get(name), self.registered_plans.get(name)
            if row is None or replayed is None:
                where = "has a row but no history entry" if replayed is None else "is in the history but has no row"
                findings.append(Finding(None, dataset.name, f"plan {name!r} {where}", row="plan"))
                continue
            expected = (replayed["tenant"], plan_jobs_json(replayed["jobs"]), replayed["epsilon"], replayed["delta"],
                        replayed["started"])
            if (row.tenant, row.jobs_json, row.epsilon, row.delta, row.started_jobs) != expected:
                findings.append(Finding(None, dataset.name, f"plan {name!r}: its row differs from what its history "
                                                            "replays to", row="plan"))
        stored_jobs = {job.reservation_id: (job.plan, job.job_index) for job in jobs}
        for reservation_id in sorted(set(stored_jobs) ^ set(self.plan_jobs)):
            where = "has a row but no history entry" if reservation_id in stored_jobs else \
                "is in the history but has no row"
            findings.append(Finding(None, dataset.name, f"job {reservation_id} of a plan {where}", row="plan job"))
        for reservation_id in sorted(set(stored_jobs) & set(self.plan_jobs)):
            if stored_jobs[reservation_id] != self.plan_jobs[reservation_id]:
                findings.append(Finding(None, dataset.name, f"job {reservation_id} of a plan: its row differs from "
                                                            "what its history replays to", row="plan job"))
        return findings

    def use_findings(self, use: StoredTenantUse) -> list[Finding]:
        """What the replay of a tenant's use found, and where its quota, tally and committed events differ from the
        use's row (not compared while no quota was ever set: the budget's replay checks the jobs)."""
        findings = list(self.findings)
        if use.quota_epsilon is None and self.budget_epsilon is None and self.dataset_quota is None:
            return findings
        for what, replayed, stored in (
            ("quota ε", self.budget_epsilon, use.quota_epsilon),
            ("RDP tally of committed and reserved steps", self.held, use.held),
            ("set of committed events", canonical(self.committed), use.committed_events),
        ):
            if replayed != stored:
                findings.append(Finding(None, self.dataset, f"the tenant's {what} is not what its history replays to"))
        return findings

    def note(self, entry: StoredEntry, problem: str) -> None:
        self.findings.append(Finding(entry.entry_id, self.dataset, problem))

    def note_structure(self, entry: StoredEntry, problem: str) -> None:
        # A tenant's use replays the same jobs as its budget, whose replay reports how they fit together.
        if not self.quota:
            self.note(entry, problem)

    def limit(self) -> tuple[float, AdmissionRule | None] | None:
        if self.budget_epsilon is not None:
            return self.budget_epsilon, self.admission
        return self.dataset_quota

    def fits(self, epsilon_of: Callable[[RdpTally], float], tally: RdpTally) -> tuple[bool, float]:
        epsilon = epsilon_of(tally)
        return fits_budget(epsilon, self.limit()[0]), epsilon

    def admission_epsilon(self, tally: RdpTally) -> float:
        # Before a file had filters (schema version 2) a job was admitted by the RDP epsilon over the whole grid.
        rule = self.limit()[1]
        return rule.epsilon(tally) if rule is not None else tally.epsilon(self.delta)

    def apply(self, entry: StoredEntry, from_dataset: bool = False) -> None:
        self.apply_details(entry, entry.action, json.loads(entry.details_json), from_dataset)

    def apply_details(
        self, entry: StoredEntry | HistoryEntry, action: str, details: dict, from_dataset: bool = False
    ) -> None:
        if action in ("create_dataset", "add_block"):
            self.budget_epsilon, self.delta = float(details["epsilon"]), float(details["delta"])
            if "admission" in details:
                self.admission = AdmissionRule.from_dict(details["admission"])
        elif action == "set_quota" and from_dataset:
            self.dataset_quota = (float(details["epsilon"]), AdmissionRule.from_dict(details["admission"]))
        elif action == "set_quota":
            self.budget_epsilon = float(details["epsilon"])
            self.admission = AdmissionRule.from_dict(details["admission"])
        elif action == "adopt_admission_rule":
            self.admission = AdmissionRule.from_dict(details["admission"])
        elif action == "raise_budget":
            self.budget_epsilon = float(details["to"])
        elif action == "register_plan":
            self.register_plan(entry, details)
        elif action == "reserve" and "plan" in details:
            self.reserve_in_plan(entry, details)
        elif action == "reserve":
            self.reserve(entry, details)
        elif action == "commit":
            self.commit(entry, details)
        elif action in ("release", "expire"):
            self.release(entry, details)

    def register_plan(self, entry: StoredEntry, details: dict) -> None:
        jobs = tuple(Composition.from_dict(job) for job in details["jobs"])
        epsilon, delta = float(details["epsilon"]), float(details["delta"])
        if details["plan"] in self.registered_plans:
            self.note(entry, f"registers plan {details['plan']!r} a second time")
        computed = plan_epsilon(jobs, delta) if self.plan_costs else epsilon
        if epsilon < computed:
            self.note(entry, f"charges plan {details['plan']!r} ε {epsilon!r}; its jobs' PLD ε is {computed!r}")
        rule, used = self.admission, self.pool_used
        if rule is None or not pool_admits(rule, used, epsilon, delta):
            pool = "no plan pool" if rule is None or not rule.has_plan_pool else \
                f"the plan pool ε {rule.plan_epsilon:g} at δ {rule.plan_delta:g}"
            self.note(entry, f"admitted plan {details['plan']!r} to ε {used.epsilon + epsilon:.6g} at δ "
                             f"{used.delta + delta:.3g}, over {pool}")
        self.registered_plans[details["plan"]] = {
            "tenant": entry.tenant, "jobs": jobs, "epsilon": epsilon, "delta": delta, "started": 0,
        }
        self.pool_used = used.plus(epsilon, delta)

    def reserve_in_plan(self, entry: StoredEntry, details: dict) -> None:
        # A tenant's use replays the job without its plan (registered on the dataset): the budget's replay checks it.
        planned = Composition.from_dict(details["planned_events"])
        if not self.quota:
            plan = self.registered_plans.get(details["plan"], {"tenant": None, "jobs": (), "started": 0})
            started = plan["started"]
            if (details["plan_job"], entry.tenant) != (started, plan["tenant"]) or started >= len(plan["jobs"]) or \
                    plan["jobs"][started] != planned:
                self.note(entry, f"starts job {details['plan_job'] + 1} of plan {details['plan']!r} with events "
                                 "the plan did not declare for its next job")
            else:
                plan["started"] = started + 1
        self.plans[details["reservation_id"]] = planned
        self.committed_steps[details["reservation_id"]] = 0
        self.plan_jobs[details["reservation_id"]] = (details["plan"], details["plan_job"])

    def reserve(self, entry: StoredEntry, details: dict) -> None:
        planned = Composition.from_dict(details["planned_events"])
        if "job_events" in details:
            job_events = Composition.from_dict(details["job_events"])
            if group_events(job_events, details["rows_per_person"]) != planned:
                self.note_structure(entry, f"charges events that are not the group-privacy bound of its job's "
                                           f"events for {details['rows_per_person']} rows per person")
        if self.limit() is not None:
            admitted, epsilon = self.fits(self.admission_epsilon, self.held + RdpTally.of(planned))
            if not admitted:
                self.note(entry, f"admitted a job to ε {epsilon:.6g} over the {self.kind} ε {self.limit()[0]:g}")
            recorded = self.recorded_held(details)
            if recorded is not None and recorded != epsilon:
                self.note(entry, f"records ε {recorded!r} held after admission; its events give {epsilon!r}")
        self.plans[details["reservation_id"]] = planned
        self.committed_steps[details["reservation_id"]] = 0
        self.held = self.held + RdpTally.of(planned)

    @property
    def committed(self) -> Composition:
        """The committed events, canonical (one record per mechanism)."""
        return Composition(tuple(
            event_of(mechanism, steps) for mechanism, steps in sorted(self.committed_steps_by_mechanism.items())
        ))

    @property
    def kind(self) -> str:
        return "quota" if self.quota else "budget"

    def commit(self, entry: StoredEntry, details: dict) -> None:
        reservation_id = details["reservation_id"]
        block = Composition.from_dict(details["events"])
        if reservation_id not in self.plans:
            self.note_structure(entry, f"commits to reservation {reservation_id}, which is not active in the replay")
            return
        _, unrun = split_steps(self.plans[reservation_id], self.committed_steps[reservation_id])
        if block.steps > unrun.steps or split_steps(unrun, block.steps)[0] != block:
            self.note_structure(
                entry, f"charges events that are not the next {block.steps} planned steps of {reservation_id}"
            )
        if reservation_id in self.plan_jobs:  # paid for with its plan
            self.committed_steps[reservation_id] += block.steps
            return
        block_tally = RdpTally.of(block)
        limit = self.limit()
        if limit is not None and limit[1] is not None:
            admitted, epsilon = self.fits(limit[1].epsilon, self.committed_tally + block_tally)
            if not admitted:
                self.note(entry, f"commits to filter ε {epsilon:.6g}, over the {self.kind} ε {limit[0]:g}")
        steps_by_mechanism = self.committed_steps_by_mechanism
        for event in block.events:
            mechanism = event.mechanism_key
            steps_by_mechanism[mechanism] = steps_by_mechanism.get(mechanism, 0) + event.steps
        self.committed_tally = self.committed_tally + block_tally
        self.committed_steps[reservation_id] += block.steps

    def release(self, entry: StoredEntry, details: dict) -> None:
        reservation_id = details["reservation_id"]
        if reservation_id not in self.plans:
            self.note_structure(entry, f"releases reservation {reservation_id}, which is not active in the replay")
            return
        plan = self.plans.pop(reservation_id)
        committed_steps = self.committed_steps.pop(reservation_id)
        in_plan = reservation_id in self.plan_jobs
        freed = 0 if in_plan else plan.steps - committed_steps
        if (details["committed_steps"], details["freed_steps"]) != (committed_steps, freed):
            self.note_structure(
                entry,
                f"records {details['committed_steps']} committed and {details['freed_steps']} freed steps of "
                f"{reservation_id}; its commits give {committed_steps} and {freed}",
            )
        if not in_plan:
            self.held = self.held - RdpTally.of(split_steps(plan, committed_steps)[1])


class ChargeReplay(BudgetReplay):
    """A budget's replay that also keeps what each job took from it (see records.JobCharge), by reservation id.

    At a job's admission, the budget's remaining ε before it and what the
    admission took (the filter's ε of what is held, after minus before); at
    each of its commits, the rise in the filter's ε of the committed steps.
    """

    def __init__(self, dataset: str, block: str | None) -> None:
        super().__init__(dataset, plan_costs=False)
        self.block = block
        self.charges: dict[str, JobCharge] = {}

    def reserve(self, entry: StoredEntry, details: dict) -> None:
        # (A job of a plan takes nothing from the filter: `reserve_in_plan` replays it, and it has no charge.)
        held_before = self.admission_epsilon(self.held)
        super().reserve(entry, details)
        self.charges[details["reservation_id"]] = JobCharge(
            self.block, max(0.0, self.budget_epsilon - held_before), self.admission_epsilon(self.held) - held_before,
            0.0,
        )

    def commit(self, entry: StoredEntry, details: dict) -> None:
        committed_before = self.admission_epsilon(self.committed_tally)
        super().commit(entry, details)
        charge = self.charges.get(details["reservation_id"])
        if charge is not None:
            self.charges[details["reservation_id"]] = replace(
                charge,
                charged_epsilon=charge.charged_epsilon + self.admission_epsilon(self.committed_tally) - committed_before,
            )


@dataclass(frozen=True)
class BurnDownPoint:
    """A dataset's figures (ε at its δ, see `budget_figures`) just after one change to it, at `at` (UTC)."""

    at: str
    action: str
    budget_epsilon: float
    spent_epsilon_filter: float
    reserved_epsilon: float
    remaining_epsilon: float

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "at": self.at,
            "action": self.action,
            "budget_epsilon": self.budget_epsilon,
            "spent_epsilon_filter": self.spent_epsilon_filter,
            "reserved_epsilon": self.reserved_epsilon,
            "remaining_epsilon": self.remaining_epsilon,
        }


def burn_down(entries: list[HistoryEntry]) -> list[BurnDownPoint]:
    """A dataset's budget over time: its figures after each change, replayed from its whole history, oldest first.

    `entries` must start at the dataset's creation (ValueError otherwise).
    The figures are those a status gives at that moment: spent (filter),
    reserved and remaining add up to the budget, so the last point equals
    the dataset's status now.
    """
    if not entries or entries[0].action != "create_dataset":
        raise ValueError("a burn-down replays a dataset's history from its creation; the first entry is not it")
    replay = BudgetReplay(entries[0].dataset or "", plan_costs=False)
    points = []
    for entry in entries:
        if entry.action in ("add_block", "set_quota") or entry.details.get("blocks"):
            continue  # a block's budget, a tenant's quota or a job on blocks: not the dataset's own budget
        replay.apply_details(entry, entry.action, entry.details)
        spent_filter = replay.admission_epsilon(replay.committed_tally)
        held_filter = replay.admission_epsilon(replay.held)
        points.append(
            BurnDownPoint(
                at=entry.at,
                action=entry.action,
                budget_epsilon=replay.budget_epsilon,
                spent_epsilon_filter=spent_filter,
                reserved_epsilon=max(0.0, held_filter - spent_filter),
                remaining_epsilon=max(0.0, replay.budget_epsilon - held_filter),
            )
        )
    return points
