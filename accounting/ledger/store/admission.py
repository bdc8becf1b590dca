"""Admission: which budgets a job is charged to, the filters it must pass, and holding, charging and freeing it.

Each dataset row carries its admission rule (admission.AdmissionRule), its
committed events in canonical form (one record per mechanism) and the exact
RDP tally (see admission.RdpTally) of committed + reserved-unrun steps, so
admission and status never read the history; a commit only rewrites the
committed events, which the figures of what is spent are computed from.
A tenant other than a dataset's owner is also held to its quota there.
"""

from __future__ import annotations

import json
import secrets
from typing import NamedTuple

from accounting.events import Composition
from accounting.ledger.admission import (
    BudgetCheck,
    RdpTally,
    assess_admission,
    block_data_overlap,
    remember_stored_tally,
    split_steps,
    stored_steps,
    stored_tally,
)
from accounting.ledger.callers import Caller
from accounting.ledger.databases import Connection
from accounting.ledger.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from accounting.ledger.store.clock import expiry
from accounting.ledger.store.datasets import DatasetRow, content_holder
from accounting.ledger.store.reservations import ReservationRow
from accounting.ledger.store.tables import Tables
from accounting.ledger.validation import ACTIVE, MAX_BUDGET_STEPS


class JobRequest(NamedTuple):
    """What a job asks to hold: whose it is, its id, the blocks it names, its charged events and their tally."""

    tenant: str
    job_id: str
    blocks: tuple[str, ...]
    planned: Composition
    tally: RdpTally
    lease_seconds: float | None


def conversion(planned: Composition, job_events: Composition, rows_per_person: int | None) -> dict:
    """What a `reserve` history entry records of a job's own events when the ledger charged it others."""
    if planned == job_events:
        return {}
    return {"job_events": job_events.to_dict(), "rows_per_person": rows_per_person}


def budget_label(reference: str, budget: DatasetRow) -> str:
    """A budget in words, for refusals: the dataset's, or one block's."""
    return f"dataset {reference!r}" if budget.block is None else f"block {budget.block!r} of dataset {reference!r}"


def blocks_detail(blocks: tuple[str, ...]) -> dict:
    """The history detail naming the blocks a job is charged to (none for a job on the dataset itself)."""
    return {"blocks": list(blocks)} if blocks else {}


def budget_rows(
    tables: Tables, connection: Connection, dataset: DatasetRow, blocks: tuple[str, ...], reference: str,
    new_job: bool = False,
) -> list[DatasetRow]:
    """The budgets a job on `blocks` of `dataset` is charged to: each block's, or the dataset's own for ().

    A `new_job` on a dataset made of blocks must name them; a job
    reserved before the dataset had blocks stays on its own budget.
    """
    rows = tables.datasets.blocks(connection, dataset.dataset_id)
    if not blocks:
        if rows and new_job:
            raise FailedPrecondition(
                f"dataset {reference!r} is made of blocks ({', '.join(row.block for row in rows)}); a job names "
                "the blocks it trains on (the config's blocks = [...], or a range of them)"
            )
        return [dataset]
    by_name = {row.block: row for row in rows}
    missing = [block for block in blocks if block not in by_name]
    if missing:
        raise NotFound(
            f"dataset {reference!r} has no block {', '.join(map(repr, missing))}; its blocks are "
            f"{', '.join(by_name) or 'none'} (dpfleet ledger block add creates one)"
        )
    undeclared = [block for block in blocks if by_name[block].block_data is None]
    if undeclared and new_job:
        raise FailedPrecondition(
            f"block {', '.join(map(repr, undeclared))} of dataset {reference!r} was added before blocks declared "
            "where their rows are, so nothing shows it owns them alone: it takes no new job. Train on blocks "
            "that declare their data (dpfleet ledger block add ... --files/--rows/--partition/--user-hash/"
            "--user-range)"
        )
    return [by_name[block] for block in blocks]


def admission_checks(
    tables: Tables, connection: Connection, tenant: str, dataset: DatasetRow, budgets: list[DatasetRow],
    planned: RdpTally, reference: str, committed: bool = False,
) -> tuple[list[BudgetCheck], list[BudgetCheck]]:
    """Every filter a job of `tenant` must pass: each budget's (in order), and the tenant's quotas where set.

    Against what is committed and reserved, or with `committed`, against
    what is committed only (a commit's check). Another tenant than the
    owner needs a quota on each budget it is charged to.
    """
    checks, quota_checks = [], []
    for budget in budgets:
        label = budget_label(reference, budget)
        if committed:
            held = stored_tally(budget.committed_events)
        else:
            held = tables.datasets.held(connection, budget.dataset_id)
        checks.append(assess_admission(label, budget.rule(), budget.budget_epsilon, held, planned))
        quota = tables.uses.quota(connection, budget, tenant)
        if quota is None:
            if tenant != dataset.tenant:
                raise PermissionDenied(
                    f"tenant {tenant!r} has no quota on {label}; an admin gives one with dpfleet ledger quota set"
                )
            continue
        if committed:
            use_held = stored_tally(tables.uses.committed_json(connection, budget.dataset_id, tenant))
        else:
            use_held = tables.uses.held(connection, budget.dataset_id, tenant)
        quota_checks.append(
            assess_admission(f"tenant {tenant!r}'s quota on {label}", quota.rule, quota.epsilon, use_held, planned)
        )
    return checks, quota_checks


def refuse_past_the_step_cap(budgets: list[DatasetRow], steps: int, reference: str) -> None:
    """Refuse (FailedPrecondition) `steps` more on a budget whose commits would then hold more than
    MAX_BUDGET_STEPS: a count no real budget reaches, which keeps every sum of steps inside int64."""
    for budget in budgets:
        composed = stored_steps(budget.committed_events)
        if composed + steps > MAX_BUDGET_STEPS:
            raise FailedPrecondition(
                f"{budget_label(reference, budget)} has composed {composed} steps; {steps} more would pass the "
                f"{MAX_BUDGET_STEPS} one budget may compose in all. Create a new dataset (or block) for new data"
            )


def refuse_unless_admitted(checks: list[BudgetCheck], reference: str) -> None:
    """Raise the refusal (BudgetExceeded) of the first check that does not fit."""
    for check in checks:
        if not check.fits:
            raise check.refusal(reference)


def hold(
    tables: Tables, connection: Connection, caller: Caller, reference: str, dataset: DatasetRow,
    budgets: list[DatasetRow], job: JobRequest, details: dict,
) -> str:
    """Admit a job on `budgets` (the dataset, or its blocks) through every budget's filter and the tenant's
    quotas (or raise BudgetExceeded), and hold it; the new reservation's id.

    `reference` is the name a refusal gives; `details` go into the `reserve` history entry besides the plan.
    """
    refuse_past_the_step_cap(budgets, job.planned.steps, reference)
    checks, quota_checks = admission_checks(tables, connection, job.tenant, dataset, budgets, job.tally, reference)
    refuse_unless_admitted([*checks, *quota_checks], reference)
    for budget in budgets:
        held = tables.datasets.held(connection, budget.dataset_id)
        tables.datasets.set_held(connection, budget.dataset_id, held + job.tally)
        use_held = tables.uses.held(connection, budget.dataset_id, job.tenant)
        tables.uses.set_held(connection, budget.dataset_id, job.tenant, use_held + job.tally)
    # The filter epsilon each budget holds after admission, as verify replays it.
    held_after = [check.held_after_epsilon for check in checks]
    placement = (
        {"blocks": list(job.blocks), "held_epsilon_filter_by_block": dict(zip(job.blocks, held_after))}
        if job.blocks else {"held_epsilon_filter": held_after[0]}
    )
    return record_reservation(tables, connection, caller, dataset, job, {**placement, **details})


def record_reservation(
    tables: Tables, connection: Connection, caller: Caller, dataset: DatasetRow, job: JobRequest, details: dict,
) -> str:
    """Add an active reservation of `job` on `dataset` and its `reserve` history entry, which records the job's
    plan and `details` (where it is held); the new reservation's id."""
    reservation_id = f"r-{secrets.token_hex(8)}"
    tables.reservations.insert(
        connection, reservation_id, dataset.dataset_id, job.tenant, job.job_id, job.planned, job.blocks,
        job.lease_seconds, expiry(job.lease_seconds),
    )
    tables.history.record(
        connection, caller, "reserve", job.tenant, dataset.dataset_id,
        {
            "reservation_id": reservation_id,
            "job_id": job.job_id,
            "planned_events": job.planned.to_dict(),
            "lease_seconds": job.lease_seconds,
            **details,
        },
    )
    return reservation_id


def events_in_words(events: Composition) -> str:
    """A job's events as a refusal names them: steps, sampling rate, noise multiplier and sensitivity of each."""
    return "; ".join(
        f"{event.steps} steps at q {event.sampling_rate:.6g}, σ {event.noise_multiplier:.6g}"
        f"{f', sensitivity ×{event.sensitivity_factor:g}' if event.sensitivity_factor != 1.0 else ''}"
        for event in events.events
    ) or "no steps"


def hold_in_plan(
    tables: Tables, connection: Connection, caller: Caller, reference: str, dataset: DatasetRow, job: JobRequest,
    plan: str,
) -> str:
    """Start the next job of the pre-registered `plan` on `dataset`: its charged events must be those the plan
    declared for it (else FailedPrecondition), and it holds nothing in the filter, the plan's pool having paid
    for it when the plan was admitted. The new reservation's id; its `reserve` entry names the plan and the job's
    place in it."""
    if job.blocks:
        raise FailedPrecondition(f"a job of plan {plan!r} runs on dataset {reference!r}'s own budget; name no blocks")
    row = tables.plans.by_name(connection, dataset.dataset_id, plan)
    if row is None or row.tenant != job.tenant:
        raise NotFound(f"dataset {reference!r} has no plan {plan!r} of tenant {job.tenant!r}; dpfleet ledger plan "
                       "list shows its plans")
    declared = row.job_events()
    if row.started_jobs >= len(declared):
        raise FailedPrecondition(f"all {len(declared)} jobs of plan {plan!r} have started, and a plan runs each of "
                                 "its jobs once; register a new plan for more")
    expected = declared[row.started_jobs]
    if job.planned != expected:
        raise FailedPrecondition(
            f"job {job.job_id!r} does not run what plan {plan!r} declared for its job {row.started_jobs + 1} of "
            f"{len(declared)}: the plan declared {events_in_words(expected)}; the job plans "
            f"{events_in_words(job.planned)}. A plan's guarantee covers only the mechanisms it declared: register a "
            "new plan for other jobs, or run this one through the filter"
        )
    reservation_id = record_reservation(
        tables, connection, caller, dataset, job, {"plan": plan, "plan_job": row.started_jobs}
    )
    tables.plans.start_job(connection, row, reservation_id)
    return reservation_id


def charge(
    tables: Tables, connection: Connection, caller: Caller, row: ReservationRow, sequence: int, steps: int
) -> int:
    """Charge the next `steps` unrun steps of an active reservation to each of its budgets as committed, renew
    its lease and record the commit of `sequence`; the reservation's committed steps after it.

    Admission keeps every commit within the filters; the check here holds
    the line for reservations made before a dataset had one (a file of
    schema version 2), or before a tenant's quota was set or lowered.
    """
    reservation = row.reservation(caller)
    _, unrun = split_steps(reservation.planned, reservation.committed_steps)
    block, _ = split_steps(unrun, steps)
    # A job of a plan was paid for when its plan was admitted: its commits record its progress, and charge no
    # budget's filter.
    budgets = []
    if reservation.plan is None:
        dataset = tables.datasets.by_id(connection, row.dataset_id)
        budgets = budget_rows(tables, connection, dataset, reservation.blocks, reservation.dataset)
        refuse_past_the_step_cap(budgets, steps, reservation.dataset)
        block_tally = RdpTally.of(block)
        checks, quota_checks = admission_checks(
            tables, connection, row.tenant, dataset, budgets, block_tally, reservation.dataset, committed=True
        )
        refuse_unless_admitted([*checks, *quota_checks], reservation.dataset)
    for budget in budgets:
        # The committed events' tallies follow from those before, for the next commit's check.
        before = stored_tally(budget.committed_events)
        remember_stored_tally(tables.datasets.add_committed_events(connection, budget, block), before + block_tally)
        use_before = stored_tally(tables.uses.committed_json(connection, budget.dataset_id, row.tenant))
        remember_stored_tally(
            tables.uses.add_committed_events(connection, budget.dataset_id, row.tenant, block),
            use_before + block_tally,
        )
    committed_steps = reservation.committed_steps + steps
    tables.reservations.set_committed(connection, reservation.reservation_id, committed_steps,
                                      expiry(reservation.lease_seconds))
    tables.reservations.insert_commit(connection, reservation.reservation_id, sequence, steps, committed_steps)
    tables.history.record(
        connection, caller, "commit", row.tenant, row.dataset_id,
        {
            "reservation_id": reservation.reservation_id,
            "job_id": reservation.job_id,
            "sequence": sequence,
            "events": block.to_dict(),
            **blocks_detail(reservation.blocks),
        },
    )
    return committed_steps


def free(tables: Tables, connection: Connection, caller: Caller, row: ReservationRow, action: str) -> None:
    """Release an active reservation's unrun steps (`action`: "release", or "expire" for a lease that ran out)."""
    reservation = row.reservation(caller)
    if reservation.state != ACTIVE:
        return
    _, unrun = split_steps(reservation.planned, reservation.committed_steps)
    if reservation.plan is None:
        unrun_tally = RdpTally.of(unrun)
        dataset = tables.datasets.by_id(connection, row.dataset_id)
        for budget in budget_rows(tables, connection, dataset, reservation.blocks, reservation.dataset):
            held = tables.datasets.held(connection, budget.dataset_id)
            tables.datasets.set_held(connection, budget.dataset_id, held - unrun_tally)
            use_held = tables.uses.held(connection, budget.dataset_id, row.tenant)
            tables.uses.set_held(connection, budget.dataset_id, row.tenant, use_held - unrun_tally)
        freed = {"freed_steps": unrun.steps}
    else:
        # Paid for with its plan: nothing goes back (a refund would depend on what the plan's jobs found).
        freed = {"freed_steps": 0, "plan": reservation.plan, "unrun_steps_not_refunded": unrun.steps}
    tables.datasets.count_released(connection, row.dataset_id)
    tables.reservations.mark_released(connection, reservation.reservation_id, action == "expire")
    tables.history.record(
        connection, caller, action, row.tenant, row.dataset_id,
        {
            "reservation_id": reservation.reservation_id,
            "job_id": reservation.job_id,
            "committed_steps": reservation.committed_steps,
            **freed,
            **blocks_detail(reservation.blocks),
        },
    )


def check_new_block(
    tables: Tables, connection: Connection, reference: str, dataset: DatasetRow, block: str, epsilon: float,
    delta: float, data: dict,
) -> None:
    """Refuse a block whose budget exceeds the dataset's, whose data may meet another block's, or on a dataset
    whose own budget was charged."""
    if epsilon > dataset.budget_epsilon or delta > dataset.delta:
        raise InvalidArgument(
            f"block {block!r} asks for ε {epsilon:g} at δ={delta:g}, above dataset {reference!r}'s budget of "
            f"ε {dataset.budget_epsilon:g} at δ={dataset.delta:g}: each unit's guarantee is its block's, and the "
            "dataset's budget is what it promises. Choose at most the dataset's ε and δ, or ask an admin to "
            "raise the budget"
        )
    if RdpTally.from_json(dataset.held_rdp) != RdpTally.zero() or tables.queue.waits_on_dataset_budget(
        connection, dataset.dataset_id
    ):
        raise FailedPrecondition(
            f"dataset {reference!r} has jobs on its own budget, which read every row, so no block of it could "
            "own its rows alone; add blocks only to a dataset before its first job (create a new dataset for "
            "the data you want in blocks)"
        )
    for other in tables.datasets.blocks(connection, dataset.dataset_id):
        reason = block_data_overlap(
            json.loads(other.block_data) if other.block_data else None, data, dataset.privacy_unit
        )
        if reason is not None:
            raise FailedPrecondition(
                f"block {block!r} may hold data of block {other.block!r} of dataset {reference!r} ({reason}); a "
                "block owns its data alone, so that no row or person is charged by two budgets. Declare data that "
                "no other block declares"
            )


def _covered(own: set[str] | None, reference: str, content: list[str]) -> bool:
    """Whether `content` is among the files bound to dataset `reference` (`own`): False when none are bound yet;
    FailedPrecondition when some are and `content` holds others."""
    if not own:
        return False
    foreign = sorted(set(content) - own)
    if foreign:
        raise FailedPrecondition(
            f"the job reads {len(foreign)} file(s) that are not dataset {reference!r}'s (one of SHA-256 "
            f"{foreign[0][:16]}…): a dataset's budget covers the rows it was first trained on, so new or changed "
            "files are another dataset (or a block of one); register them under a name of their own"
        )
    return True


def content_is_bound(
    tables: Tables, connection: Connection, reference: str, dataset: DatasetRow, content: list[str]
) -> bool:
    """Whether `content` is among the files bound to `dataset` already (True: nothing to write); False when none
    are bound yet; FailedPrecondition when some are and `content` holds others. Reads only: a snapshot will do."""
    return _covered(tables.datasets.recorded_content(connection).get(dataset.dataset_id), reference, content)


def bind_content(
    tables: Tables, connection: Connection, caller: Caller, reference: str, dataset: DatasetRow, content: list[str]
) -> None:
    """Bind `content` (the SHA-256s of the files a job reads) to `dataset` on its first use, or check that they are
    among the files bound before; refuse (FailedPrecondition) files another dataset holds, so that the same rows
    get one budget whatever the dataset they are trained under.

    A first binding is a `bind_content` history entry; a check writes nothing.
    """
    recorded = tables.datasets.recorded_content(connection)
    if _covered(recorded.get(dataset.dataset_id), reference, content):
        return
    holder = content_holder(recorded, content, besides=dataset.dataset_id)
    if holder is not None:
        other = tables.datasets.by_id(connection, holder[0])
        # Another tenant's dataset is not named to a tenant: its name is that tenant's to tell.
        holder_name = (f"dataset {other.tenant}/{other.name}" if caller.admin or other.tenant == caller.tenant
                       else "another tenant's dataset")
        raise FailedPrecondition(
            f"the data the job reads is already {holder_name}'s (a file of SHA-256 "
            f"{holder[1][:16]}… is in both): rows get one budget, whatever their dataset is called and wherever "
            f"their files are; train under that name"
        )
    tables.history.record(connection, caller, "bind_content", dataset.tenant, dataset.dataset_id,
                          {"content": content})
