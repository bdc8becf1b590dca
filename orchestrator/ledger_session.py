"""A training job's side of the privacy ledger: reserve the plan, charge blocks before they run, release the rest.

The ledger is either a `dpfleet ledger serve` server (`--ledger HOST:PORT`,
or DPFLEET_LEDGER) or, by default, the embedded SQLite ledger used in-process
through the same admission code as a server.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from datetime import datetime, timezone
from typing import Callable, Mapping

from accounting.events import Composition
from accounting.ledger.admission import (
    FitReport,
    RdpTally,
    assess_admission,
    charged_plan,
    check_block_data,
    rule_with_pool,
    split_budget,
)
from accounting.ledger.callers import LOCAL_TENANT
from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import (
    AlreadyExists,
    BudgetExceeded,
    FailedPrecondition,
    InvalidArgument,
    LedgerUnavailable,
    NotFound,
    PermissionDenied,
)
from accounting.ledger.records import BlockStatus, DatasetStatus, JobCharge, QueuedJob, Reservation
from accounting.ledger.store import open_embedded_ledger
from accounting.ledger.validation import ACTIVE, ADMITTED, NAME_LENGTH, QUEUED
from orchestrator import release
from orchestrator.errors import BudgetRefusedError, LedgerTimeoutError, UsageError
from workers.fingerprints import block_identity, file_digests
from workers.sources import DataError, spec_name

_FIRST_BACKOFF_SECONDS = 0.5
_LONGEST_BACKOFF_SECONDS = 10.0
# How often a waiting job asks the ledger where it stands, and how often it says so when nothing changed.
_QUEUE_POLL_SECONDS = 1.0
_QUEUE_REMINDER_SECONDS = 60.0
# Between a run's first job id and the unique part of a resumed run's: the first job id stays readable in it.
_RESUMED = ".resumed-"


def open_ledger(address: str | None, token: str | None):
    """The ledger at `address` (or DPFLEET_LEDGER) with `token` (or DPFLEET_TOKEN); else the embedded one."""
    address = address or os.environ.get("DPFLEET_LEDGER")
    if not address:
        return open_embedded_ledger()
    token = token or os.environ.get("DPFLEET_TOKEN")
    if not token:
        raise UsageError(
            f"the ledger at {address} needs a token: pass --token or set DPFLEET_TOKEN "
            "(dpfleet ledger tenant create prints one)"
        )
    return RemoteLedger(address, token)


def is_embedded(ledger) -> bool:
    """True for the in-process SQLite ledger."""
    return not isinstance(ledger, RemoteLedger)


def new_job_id(run_dir: str) -> str:
    """A job id that names the run and is unique."""
    return f"{os.path.basename(os.path.normpath(run_dir)) or 'run'}-{uuid.uuid4().hex[:8]}"


def resumed_job_id(job_id: str) -> str:
    """A job id for a resumed run's new reservation: the run's first job id, which it names, and a unique part."""
    first = job_id.split(_RESUMED)[0][:NAME_LENGTH[1] - len(_RESUMED) - 8]
    return f"{first}{_RESUMED}{uuid.uuid4().hex[:8]}"


def reservation_gone(reservation: Reservation) -> str | None:
    """How a reservation stopped holding its unrun steps ("was released", "lapsed as its lease ran out"), or None
    while it holds them. A lease past its end counts as run out before the ledger's sweep has released it."""
    if reservation.lease_expired or (reservation.state == ACTIVE and reservation.expires_at is not None and
                                     datetime.fromisoformat(reservation.expires_at) <= datetime.now(timezone.utc)):
        return "lapsed as its lease ran out"
    return None if reservation.state == ACTIVE else "was released"


def with_retries(call: Callable, timeout_seconds: float, say: Callable[[str], None], what: str):
    """`call()`, retried with exponential backoff while the ledger is unreachable, for up to `timeout_seconds`."""
    deadline = time.monotonic() + timeout_seconds
    backoff = _FIRST_BACKOFF_SECONDS
    warned = False
    while True:
        try:
            result = call()
        except LedgerUnavailable as error:
            if time.monotonic() + backoff > deadline:
                raise LedgerTimeoutError(
                    f"the ledger stayed unreachable for {timeout_seconds:g} s while {what}: {error}"
                ) from None
            if not warned:
                say(release.line("ledger_unreachable", what=what, seconds=f"{timeout_seconds:g}"))
                warned = True
            time.sleep(backoff)
            backoff = min(2 * backoff, _LONGEST_BACKOFF_SECONDS)
            continue
        if warned:
            say(release.line("ledger_reachable"))
        return result


class JobLedger:
    """One job's reservation: the trainer's LedgerSession."""

    def __init__(self, ledger, dataset: str, reservation_id: str, timeout_seconds: float, say: Callable[[str], None],
                 plan: str | None = None):
        self.ledger = ledger
        self.dataset = dataset
        self.reservation_id = reservation_id
        self.timeout_seconds = timeout_seconds
        self.say = say
        # The pre-registered plan the job runs in (it takes nothing from the filter), or None.
        self.plan = plan

    @classmethod
    def reserve(
        cls, ledger, dataset: str, job_id: str, plan_for_unit: Callable[[str], tuple[Composition, str, int | None]],
        timeout_seconds: float, say: Callable[[str], None], lease_seconds: float | None = None,
        blocks: tuple[str, ...] = (), plan: str | None = None,
    ) -> "JobLedger":
        """Hold the whole planned run on `dataset` (each of `blocks` in full), or raise BudgetRefusedError (exit 3).

        `plan_for_unit(privacy unit of the dataset)` gives the events to
        reserve, the unit they protect and the rows-per-person bound (see
        RunPlan.ledger_plan). With `lease_seconds`, the hold lapses unless a
        charge renews it that often. With `plan`, the run is the next job of
        that pre-registered plan, paid for with it.
        """
        def reserve():
            planned, privacy_unit, rows_per_person = _plan_for_dataset(ledger, dataset, plan_for_unit)
            release.sent("ledger", "reserve")
            return ledger.reserve(dataset, job_id, planned, lease_seconds, privacy_unit, rows_per_person, blocks, plan)

        try:
            reservation = with_retries(reserve, timeout_seconds, say, "reserving budget")
        except (BudgetExceeded, PermissionDenied, FailedPrecondition, NotFound) as error:
            raise BudgetRefusedError(f"the ledger refused to start the job: {error}") from None
        return cls(ledger, dataset, reservation.reservation_id, timeout_seconds, say, plan)

    @classmethod
    def wait_for_budget(
        cls, ledger, dataset: str, job_id: str, plan_for_unit: Callable[[str], tuple[Composition, str, int | None]],
        timeout_seconds: float, say: Callable[[str], None], lease_seconds: float | None = None,
        blocks: tuple[str, ...] = (), priority: int = 0, max_wait_seconds: float | None = None,
    ) -> "JobLedger":
        """Queue the planned run on `dataset` and wait until its policy admits it; BudgetRefusedError (exit 3)
        when it could never fit, is cancelled, or waits past `max_wait_seconds`.

        `plan_for_unit` and `blocks` as in `reserve`. Says where the job stands whenever
        its position or reason changes. An interrupt (Ctrl-C) while waiting
        takes it out of the queue.
        """
        def enqueue():
            planned, privacy_unit, rows_per_person = _plan_for_dataset(ledger, dataset, plan_for_unit)
            release.sent("ledger", "enqueue")
            return ledger.enqueue(dataset, job_id, planned, lease_seconds, priority, max_wait_seconds, privacy_unit,
                                  rows_per_person, blocks)

        try:
            queued = with_retries(enqueue, timeout_seconds, say, "queueing for budget")
        except (BudgetExceeded, PermissionDenied, FailedPrecondition, NotFound) as error:
            raise BudgetRefusedError(f"the ledger refused to queue the job: {error}") from None
        started, shown, shown_at = time.monotonic(), None, 0.0
        try:
            while queued.state == QUEUED:
                now = time.monotonic()
                if (queued.position, queued.reason) != shown or now - shown_at >= _QUEUE_REMINDER_SECONDS:
                    say(_waiting_line(queued, now - started))
                    shown, shown_at = (queued.position, queued.reason), now
                time.sleep(_QUEUE_POLL_SECONDS)
                queued = with_retries(lambda: ledger.queued_job(queued.queue_id), timeout_seconds, say,
                                      "waiting for budget")
        except KeyboardInterrupt:
            with_retries(lambda: ledger.cancel_queued(queued.queue_id), timeout_seconds, say, "leaving the queue")
            raise
        if queued.state != ADMITTED:
            raise BudgetRefusedError(
                f"the job left the queue of {dataset!r} without budget ({queued.state}: {queued.reason}) after "
                f"{time.monotonic() - started:.0f} s; dpfleet ledger jobs --queued shows the queue"
            )
        say(release.line("ledger_admitted", seconds=f"{time.monotonic() - started:.0f}", reason=queued.reason))
        return cls(ledger, dataset, queued.reservation_id, timeout_seconds, say)

    @classmethod
    def held(cls, ledger, dataset: str, reservation_id: str, timeout_seconds: float,
             say: Callable[[str], None]) -> Reservation:
        """Reservation `reservation_id` on `dataset` as the ledger holds it now (a resumed run's), or UsageError
        when this ledger and token hold no such reservation there."""
        try:
            jobs = with_retries(lambda: ledger.list_jobs(dataset), timeout_seconds, say,
                                "reading the run's reservation")
        except (NotFound, PermissionDenied) as error:
            jobs, refusal = [], f": {error}"
        else:
            refusal = ""
        found = [job for job in jobs if job.reservation_id == reservation_id]
        if not found:
            raise UsageError(
                f"the ledger holds no reservation {reservation_id} on dataset {dataset!r} for this token{refusal}; "
                "resume against the ledger the run was charged to (--ledger and --token, or the config's ledger)"
            )
        return found[0]

    def close(self) -> None:
        """Close the ledger it charges; an embedded one first ends the composition it runs in the background
        after commits, so that no thread of it is still computing as the process ends."""
        self.ledger.close()

    def charge(self, sequence: int, events: Composition) -> None:
        """Commit block `sequence` before it runs; a repeat of the same block charges nothing more."""
        release.sent("ledger", "commit")
        with_retries(
            lambda: self.ledger.commit(self.reservation_id, events.steps, sequence),
            self.timeout_seconds,
            self.say,
            f"charging block {sequence}",
        )

    def release(self) -> None:
        """Free the planned steps that never ran."""
        release.sent("ledger", "release")
        with_retries(lambda: self.ledger.release(self.reservation_id), self.timeout_seconds, self.say,
                     "releasing unused budget")

    def status(self) -> DatasetStatus:
        """The dataset's budget as the ledger sees it now."""
        return with_retries(lambda: self.ledger.get_budget(self.dataset), self.timeout_seconds, self.say,
                            "reading the budget")

    def charges(self) -> tuple[JobCharge, ...]:
        """What the reservation took from each budget it is charged to as it was admitted, and what its commits
        took since (records.JobCharge), as the ledger replays them; () from a ledger that does not say."""
        jobs = with_retries(lambda: self.ledger.list_jobs(self.dataset, ACTIVE, charges=True), self.timeout_seconds,
                            self.say, "reading the reservation's charge")
        return next((job.charges or () for job in jobs if job.reservation_id == self.reservation_id), ())


def _plan_for_dataset(
    ledger, dataset: str, plan_for_unit: Callable[[str], tuple[Composition, str, int | None]],
) -> tuple[Composition, str, int | None]:
    """`plan_for_unit` of the dataset's privacy unit; the status is read without waiting for its PLD figure."""
    return plan_for_unit(ledger.get_budget(dataset, pld_may_be_pending=True).privacy_unit)


def _waiting_line(queued: QueuedJob, waited_seconds: float) -> str:
    """One line on where a waiting job stands."""
    deadline = f", gives up at {queued.deadline}" if queued.deadline else ""
    return release.line("ledger_waiting", dataset=repr(queued.dataset), queue=queued.queue_id,
                        position=queued.position, reason=queued.reason, seconds=f"{waited_seconds:.0f}",
                        deadline=deadline)


def bind_dataset_content(ledger, dataset: str, content: list[str] | None) -> None:
    """Before a job on `dataset` itself (no blocks) reserves: bind the SHA-256s of the files it reads to the
    dataset on its first use, or have the ledger check that they are the dataset's own, embedded or served alike.

    UsageError, naming the refusal, when another dataset holds one of the
    files or the files are not the dataset's: the same rows get one budget
    whatever the dataset they are trained under. `content` is
    ``file_digests`` of the run's dataset: None (nothing to bind) for a
    built-in or `module:function` dataset, whose name says what it is.
    """
    if content is None:
        return
    release.sent("ledger", "bind_content")
    try:
        ledger.bind_content(dataset, content)
    except FailedPrecondition as error:
        raise UsageError(str(error)) from None


def ensure_embedded_dataset(
    ledger, dataset: str, budget_epsilon: float, delta: float, privacy_unit: str, say: Callable[[str], None],
    blocks: tuple[str, ...] = (), declarations: Mapping[str, dict] | None = None, user_id: str | None = None,
    spec: str | Mapping | None = None, named_after: str | None = None, plan_share: float = 0.0,
) -> None:
    """Register `dataset` and each of its `blocks` in the embedded ledger on first use, with the given budget
    (`plan_share` of it set aside as its plan pool).

    `named_after` is the train location the name was made from (`name_origin`), which the line that says so names.

    On first use the ledger records the SHA-256 of each of `spec`'s training
    files and refuses (UsageError, naming it) when a dataset already holds
    one, so the same rows moved or renamed get no second budget.
    `declarations` are where each block's rows are (the config's
    [dataset.blocks]); each goes with the identity of its files
    (`with_identity`, people by the `user_id` column on a per-person
    dataset), and the ledger stores them and refuses blocks that share data.
    """
    try:
        status = ledger.get_budget(dataset, pld_may_be_pending=True)
    except (NotFound, PermissionDenied):
        content = file_digests(spec) if spec is not None else None
        try:
            status = ledger.register_dataset(dataset, budget_epsilon, delta, privacy_unit, content=content,
                                             plan_share=plan_share)
            per = " per person" if privacy_unit == "user" else ""
            pool = f" ({plan_share:.0%} of it set aside as its plan pool)" if plan_share else ""
            say(release.line("ledger_registered", dataset=repr(dataset), epsilon=f"{budget_epsilon:g}{per}",
                             delta=f"{delta:g}{pool}", origin=origin_note(dataset, named_after)))
        except AlreadyExists:
            # Another job's first use registered it since this one looked: the same dataset, registered once.
            status = ledger.get_budget(dataset, pld_may_be_pending=True)
        except FailedPrecondition as error:
            raise UsageError(str(error)) from None
    known = {block.name for block in status.blocks}
    # A block's budget is at most its dataset's.
    block_epsilon = min(budget_epsilon, status.budget_epsilon)
    for block in blocks:
        if block not in known:
            ledger.add_block(dataset, block, block_epsilon, None,
                             with_identity(block, (declarations or {}).get(block), status, user_id))
            say(release.line("ledger_registered_block", block=repr(block), dataset=repr(dataset),
                             epsilon=f"{block_epsilon:g}"))


def people_salt(status: DatasetStatus) -> str:
    """The key people's digests in a block's identity are made under: the dataset's tenant/name, one per dataset,
    so that a person's digest in one dataset says nothing of the same person in another."""
    return f"{status.tenant}/{status.name.rsplit('/', 1)[-1]}"


def with_identity(block: str, declaration: dict | None, status: DatasetStatus, user_id: str | None) -> dict | None:
    """A block's declaration with the identity of what its files hold (`workers.fingerprints.block_identity`),
    computed here, where the files are read; a declaration without files is as given.

    On a per-person dataset the identity names the block's people by
    `user_id` (the column naming each row's person), which must be given.
    """
    if not declaration or "files" not in declaration:
        return declaration
    per_person = status.privacy_unit == "user"
    if per_person and user_id is None:
        raise UsageError(
            f"block {block!r} of the per-person dataset {status.name!r} is known by its people: name the column "
            "of each row's person (user_id in the config, --user-id for dpfleet ledger block add)"
        )
    files = sorted(set(declaration["files"]))
    try:
        identity = block_identity(files, user_id if per_person else None, people_salt(status))
    except DataError as error:
        raise UsageError(f"block {block!r}: {error}") from None
    return {**declaration, "identity": identity}


def check_declared_blocks(
    status: DatasetStatus, blocks: tuple[str, ...], declarations: Mapping[str, dict], user_id: str | None = None,
) -> None:
    """Refuse a run whose config reads other rows than the ledger's blocks declare (UsageError).

    `declarations` are the config's [dataset.blocks]; each chosen block's,
    with the identity of the files it reads now (`with_identity`), must be
    the declaration the ledger stores for it, so that the run reads only
    the rows its charge is bound to: a link, a URL, a copy or a file whose
    rows changed is refused here, before the job reserves. A block stored
    before declarations carried identities is compared by its locations
    and selector only. A block the ledger holds no declaration for is left
    to the ledger, which admits no new job on it.
    """
    stored = {block.name: block.data for block in status.blocks}
    for block in blocks:
        if stored.get(block) is None:
            continue
        try:
            declared = check_block_data(with_identity(block, declarations.get(block), status, user_id),
                                        status.privacy_unit)
        except InvalidArgument as error:
            raise UsageError(f"dataset.blocks.{block}: {error}") from None
        if "identity" not in stored[block]:
            declared.pop("identity", None)
        if declared != stored[block]:
            raise UsageError(
                f"block {block!r} of dataset {status.name!r} is bound in the ledger to {_shown(stored[block])}, but "
                f"the config reads {_shown(declared)}; a run reads only the rows its blocks declare: make "
                f"[dataset.blocks] {block} declare the same files, holding the same bytes (dpfleet ledger status "
                "--json shows each block's data)"
            )


def _shown(declaration: dict) -> dict:
    """A declaration as an error names it: its identity's file digests, never its people's."""
    identity = declaration.get("identity")
    if identity is None:
        return declaration
    return {**declaration, "identity": {"files": identity["files"], **(
        {"user_id": identity["user_id"], "people": len(identity["people"])} if "people" in identity else {})}}


def _charged_budgets(
    plan, status: DatasetStatus, blocks: tuple[str, ...], start: int = 0,
) -> tuple[RdpTally, list[tuple[str | None, DatasetStatus | BlockStatus]]]:
    """The tally of the events the ledger charges for `plan` from step `start` on (`plan.ledger_plan` of the
    dataset's unit, converted by `charged_plan`), and the budgets it charges them to: (block name, its status)
    for each of `blocks`, or (None, the dataset's status)."""
    planned, privacy_unit, rows_per_person = plan.ledger_plan(status.privacy_unit, start)
    tally = RdpTally.of(charged_plan(status.name, status.privacy_unit, privacy_unit, planned, rows_per_person))
    by_name = {block.name: block for block in status.blocks}
    return tally, [(block, by_name[block]) for block in blocks if block in by_name] or [(None, status)]


def filter_charges(
    plan, status: DatasetStatus, blocks: tuple[str, ...], start: int = 0,
) -> list[tuple[str, float]]:
    """The RDP-filter ε each budget a job is charged to (the dataset's, or each of `blocks`) gives `plan` from
    step `start` on, as if the budget held nothing: what target_epsilon_basis = "filter" calibrates σ to.

    Each ε is the filter's at that budget's orders and δ. A budget already
    in use counts the job's divergence at each order on top of what it
    holds, which moves the filter's ε by a different amount: what the job
    takes from the budget is the FitReport's (dpfleet ledger fits and the
    start line of dpfleet train say it, `takes_phrase`).
    """
    tally, budgets = _charged_budgets(plan, status, blocks, start)
    return [(f"block {block}" if block else f"dataset {status.name}", budget.admission.epsilon(tally))
            for block, budget in budgets]


def first_use_status(dataset: str, config) -> DatasetStatus:
    """The status `dataset` would have once `dpfleet train` registered it, and the config's blocks, in the
    embedded ledger on first use (`ensure_embedded_dataset`): the config's budget and privacy unit, nothing
    held."""
    rule = rule_with_pool(config.dataset_budget_epsilon, config.delta, config.dataset_plan_share)
    (epsilon, delta), _ = split_budget(config.dataset_budget_epsilon, config.delta, config.dataset_plan_share)
    blocks = tuple(BlockStatus(block, epsilon, delta, rule, 0.0, 0.0, 0.0, 0.0, epsilon) for block in config.blocks)
    return DatasetStatus(dataset, LOCAL_TENANT, epsilon, delta, rule, 0.0, 0.0, 0.0, 0.0, epsilon,
                         privacy_unit=config.privacy_unit, blocks=blocks)


def first_use_fits(plan, status: DatasetStatus, blocks: tuple[str, ...]) -> FitReport:
    """The ledger's answer to `plan` on a dataset that holds nothing yet (`first_use_status`): each budget's
    filter checked with nothing held, as `Ledger.fits` checks it."""
    tally, budgets = _charged_budgets(plan, status, blocks)
    checks = tuple(
        assess_admission(f"block {block!r} of dataset {status.name!r}" if block else f"dataset {status.name!r}",
                         budget.admission, budget.budget_epsilon, RdpTally.zero(), tally)
        for block, budget in budgets
    )
    return FitReport(status.name, blocks, checks)


def job_fits_now(ledger, dataset: str, config) -> tuple:
    """Whether `config`'s job would be admitted on `dataset` now: (its RunPlan, the dataset's status, the
    ledger's FitReport, whether the dataset is registered); nothing is reserved, nothing registered.

    A dataset the embedded ledger does not hold yet is answered as
    `dpfleet train` would register it on first use (`first_use_status`).
    Blocks the config declares otherwise than the ledger are a UsageError
    first, as at a reservation. With target_epsilon_basis = "filter", σ is
    calibrated to the budget's filter, as the trainer calibrates it.
    """
    from orchestrator.planning import plan_run  # the accountants, not torch

    try:
        status, registered = ledger.get_budget(dataset, pld_may_be_pending=True), True
    except NotFound:
        if not is_embedded(ledger):
            raise
        status, registered = first_use_status(dataset, config), False
        content = file_digests(config.dataset)
        # As the first use would refuse it: rows that another dataset registered get no second budget.
        if content is not None:
            try:
                ledger.check_registrable(dataset, content)
            except FailedPrecondition as error:
                raise UsageError(str(error)) from None
    check_declared_blocks(status, config.blocks, block_declarations(config), config.user_id)
    plan = plan_run(config, charge_epsilon=status_basis(status, config.blocks)
                    if config.target_epsilon_basis == "filter" else None)
    if not registered:
        return plan, status, first_use_fits(plan, status, config.blocks), False
    planned, privacy_unit, rows_per_person = plan.ledger_plan(status.privacy_unit)
    release.sent("ledger", "fits")
    return plan, status, ledger.fits(dataset, planned, config.blocks, privacy_unit, rows_per_person), True


def register_plan_of(ledger, dataset: str, plan: str, configs: list, delta: float | None = None):
    """Register the jobs of `configs`, in order, as the pre-registered `plan` on `dataset` (PlanStatus), each
    planned as `dpfleet train` plans it and charged in the dataset's privacy unit; a refusal of the ledger is
    raised as it is (BudgetExceeded past the pool).

    UsageError for a config whose plan is only known once it runs (shards,
    whose size comes from the silos) or that names blocks (a plan is
    charged to the dataset's own pool).
    """
    from orchestrator.planning import plan_run  # the accountants, not torch

    for config in configs:
        if config.shards or config.blocks:
            raise UsageError("a plan's jobs are fixed before any runs, on the dataset's own pool: a config with "
                             f"{'shards' if config.shards else 'blocks'} cannot be part of one")
    unit = ledger.get_budget(dataset, pld_may_be_pending=True).privacy_unit
    planned = [plan_run(config).ledger_plan(unit) for config in configs]
    units = {(privacy_unit, rows_per_person) for _, privacy_unit, rows_per_person in planned}
    if len(units) > 1:
        raise UsageError("a plan's jobs protect one privacy unit with one bound on rows per person; these differ")
    ((privacy_unit, rows_per_person),) = units
    release.sent("ledger", "register_plan")
    return ledger.register_plan(dataset, plan, [events for events, _, _ in planned], delta, privacy_unit,
                                rows_per_person)


def filter_basis(ledger, dataset: str, blocks: tuple[str, ...]) -> Callable:
    """For target_epsilon_basis = "filter": `status_basis` of the dataset as the ledger holds it now."""
    return status_basis(ledger.get_budget(dataset, pld_may_be_pending=True), blocks)


def status_basis(status: DatasetStatus, blocks: tuple[str, ...]) -> Callable:
    """For target_epsilon_basis = "filter": a plan's largest filter charge over the budgets of `status` it is
    charged to."""
    return lambda plan: max(epsilon for _, epsilon in filter_charges(plan, status, blocks))


def takes_phrase(takes: list[tuple[str | None, float, float]]) -> str:
    """How much of each budget a job takes, as `dpfleet train`'s start line and `dpfleet ledger fits` say it:
    `ε 1.83 of the budget (remaining 10 → 8.17)`, or one such part per block of a job on blocks.

    `takes` holds, per budget, (its block, or None for the dataset's own;
    the filter's ε the job takes from it, the conversion offset included
    where the budget held nothing; the remaining ε before the job).
    """
    if not takes:
        return "an ε this ledger does not report"
    return ", ".join(
        f"ε {taken:.3g} of {f'block {block!r}' if block else 'the budget'} (remaining {remaining:.3g} → "
        f"{remaining - taken:.3g})"
        for block, taken, remaining in takes
    )


def fits_takes(report: FitReport) -> list[tuple[str | None, float, float]]:
    """`takes_phrase`'s parts of a FitReport: each budget's (the dataset's or each block's, not a tenant's quota)
    ε the job needs and remaining ε now."""
    budgets = report.blocks or (None,)
    return [(block, check.needed_epsilon, check.remaining_epsilon) for block, check in zip(budgets, report.checks)]


def ledger_name(name: str) -> str:
    """A ledger-valid dataset name for a spec's name: other characters become '-', at most 128 of them.

    A path or ``module:function`` is not a valid ledger name as it is; give
    ``dataset_name`` to choose the name yourself.
    """
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-")
    return cleaned[-128:] or "dataset"


def name_origin(dataset_name: str | None, config) -> str | None:
    """The train location a table's ledger name is made from (`ledger_dataset_name`); None where a name was chosen
    (--dataset-name, dataset_name, the table's `name`) or the dataset is a built-in or a function."""
    spec = config.dataset
    if dataset_name or config.dataset_name or not isinstance(spec, Mapping) or "name" in spec:
        return None
    return spec_name(spec)


def origin_note(dataset: str, named_after: str | None) -> str:
    """The end of the registration line for a name made from a path: moved files keep their budget only by name."""
    if named_after is None:
        return ""
    return (f"; its name comes from the train location {named_after}: if the files move, set dataset_name = "
            f"\"{dataset}\" to go on spending this budget (the ledger refuses the same files under a second name)")


def ledger_dataset_name(dataset_name: str | None, config) -> str:
    """The dataset's name in the ledger: `dataset_name` (--dataset-name), else the config's, else its spec's name."""
    return dataset_name or config.dataset_name or ledger_name(spec_name(config.dataset))


def block_declarations(config) -> dict:
    """Where the config says each block's rows are (its [dataset.blocks]), by block name."""
    return dict(config.dataset.get("blocks") or {}) if isinstance(config.dataset, dict) else {}
