"""The ledger's operations, declared once: `OPERATIONS`.

Each operation is one method of the embedded `Ledger` (accounting.ledger.store)
and of `RemoteLedger` (accounting.ledger.client), with the same parameters and
defaults (the store's take the caller as a keyword-only `caller` besides); one
RPC of accounting/ledger.proto, whose request fields carry those parameters;
and, for most, one `dpfleet ledger` command, whose options give them.
Here each is written down once: its parameters with their defaults, the
request fields that carry each, the LedgerError subclasses it may raise, its
RPC with its request and reply messages, and its command.
tests/test_ledger_operations.py checks the store, the client, the servicer,
the proto and the command line against it; the servicer's history limit and
the command line's history limit and privacy unit are its defaults.

Loads no gRPC: the command line reads it to build its parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
from accounting.ledger.validation import EXAMPLE


class _Required:
    """The default of a parameter that has none."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()

# What any operation may raise: a bad value, an unknown token, too many failed tries or costly requests, a ledger
# whose state or database refuses (a read-only or closed database), and, through RemoteLedger, no server answering.
EVERY_OPERATION_ERRORS: tuple[type[LedgerError], ...] = (
    InvalidArgument, Unauthenticated, RateLimited, FailedPrecondition, LedgerUnavailable,
)


@dataclass(frozen=True)
class Parameter:
    """One parameter of an operation: its name (the store's and the client's), its default, its request fields.

    `fields` are the request message's fields that carry it: its own name
    unless the wire needs another shape (a plan travels as its JSON).
    """

    name: str
    default: object = REQUIRED
    fields: tuple[str, ...] = ()

    @property
    def request_fields(self) -> tuple[str, ...]:
        """The request fields that carry this parameter."""
        return self.fields or (self.name,)


@dataclass(frozen=True)
class Command:
    """The `dpfleet ledger` command of an operation.

    `words` follow `dpfleet ledger`. `options` name, for each parameter the
    command passes on as given, the argparse destination it comes from;
    `derived` for each parameter the command computes, the destinations it
    computes it from (a plan from a training config, a block's rows from its
    location flags). A parameter in neither takes its default.
    """

    words: tuple[str, ...]
    options: dict[str, str] = field(default_factory=dict)
    derived: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Operation:
    """One ledger operation in every layer: store and client method, RPC and messages, command."""

    name: str
    parameters: tuple[Parameter, ...]
    errors: tuple[type[LedgerError], ...]
    rpc: str
    request: str
    reply: str
    command: Command | None = None

    def parameter(self, name: str) -> Parameter:
        """The parameter called `name`."""
        for parameter in self.parameters:
            if parameter.name == name:
                return parameter
        raise KeyError(f"{self.name} has no parameter {name!r}; it has {[p.name for p in self.parameters]}")

    def default(self, name: str) -> object:
        """The default of the parameter called `name` (REQUIRED when it has none)."""
        return self.parameter(name).default


def _errors(*specific: type[LedgerError]) -> tuple[type[LedgerError], ...]:
    return EVERY_OPERATION_ERRORS + specific


_PLAN = Parameter("planned", fields=("planned_events_json",))
_LEASE = Parameter("lease_seconds", None)
_PRIVACY_UNIT = Parameter("privacy_unit", EXAMPLE)
_ROWS_PER_PERSON = Parameter("rows_per_person", None)
_BLOCKS = Parameter("blocks", ())
_PENDING = Parameter("pld_may_be_pending", False)

_DECLARED = (
    Operation(
        "create_tenant", (Parameter("tenant"),), _errors(AlreadyExists, PermissionDenied),
        "CreateTenant", "CreateTenantRequest", "CreateTenantReply",
        Command(("tenant", "create"), {"tenant": "name"}),
    ),
    Operation(
        # None asks for the admin token of the call: on the wire, `admin` set and no tenant.
        "rotate_token", (Parameter("tenant", None, ("tenant", "admin")),), _errors(NotFound, PermissionDenied),
        "RotateToken", "RotateTokenRequest", "CreateTenantReply",
        Command(("token", "rotate"), derived={"tenant": ("tenant", "admin")}),
    ),
    Operation(
        # The wire and the command line say whose key it is.
        "revoke_token", (Parameter("tenant", None), Parameter("key_id", None, ("admin_key_id",))),
        _errors(NotFound, PermissionDenied),
        "RevokeToken", "RevokeTokenRequest", "RevokeTokenReply",
        Command(("token", "revoke"), {"tenant": "tenant", "key_id": "admin_key_id"}),
    ),
    Operation(
        "create_dataset",
        (Parameter("dataset"), Parameter("epsilon"), Parameter("delta"), _PRIVACY_UNIT, Parameter("scheduling", None),
         Parameter("plan_share", 0.0)),
        _errors(AlreadyExists, NotFound, PermissionDenied),
        "CreateDataset", "CreateDatasetRequest", "DatasetStatus",
        Command(
            ("dataset", "create"),
            {"dataset": "name", "epsilon": "epsilon", "delta": "delta", "privacy_unit": "privacy_unit",
             "plan_share": "plan_share"},
            {"scheduling": ("scheduling", "unlock_jobs", "unlock_seconds")},
        ),
    ),
    Operation(
        "raise_budget", (Parameter("dataset"), Parameter("epsilon")), _errors(NotFound, PermissionDenied),
        "RaiseBudget", "RaiseBudgetRequest", "DatasetStatus",
        Command(("dataset", "raise"), {"dataset": "name", "epsilon": "epsilon"}),
    ),
    Operation(
        "get_budget", (Parameter("dataset"), _PENDING), _errors(NotFound, PermissionDenied),
        "GetBudget", "GetBudgetRequest", "DatasetStatus",
        Command(("status",), {"dataset": "dataset", "pld_may_be_pending": "no_wait"}),
    ),
    Operation(
        "list_datasets", (_PENDING,), _errors(),
        "ListDatasets", "ListDatasetsRequest", "ListDatasetsReply",
        Command(("status",), {"pld_may_be_pending": "no_wait"}),
    ),
    Operation(
        "list_jobs", (Parameter("dataset", None), Parameter("state", None), Parameter("charges", False)),
        _errors(NotFound, PermissionDenied),
        "ListJobs", "ListJobsRequest", "ListJobsReply",
        # `jobs` shows what each job took from its budgets.
        Command(("jobs",), {"dataset": "dataset"}, {"state": ("active",), "charges": ()}),
    ),
    Operation(
        "reserve",
        (Parameter("dataset"), Parameter("job_id"), _PLAN, _LEASE, _PRIVACY_UNIT, _ROWS_PER_PERSON, _BLOCKS,
         Parameter("plan", None)),
        _errors(BudgetExceeded, NotFound, PermissionDenied),
        "Reserve", "ReserveRequest", "Reservation",
    ),
    Operation(
        # A plan's jobs travel as their JSON, one string each.
        "register_plan",
        (Parameter("dataset"), Parameter("plan"), Parameter("jobs", fields=("jobs_json",)), Parameter("delta", None),
         _PRIVACY_UNIT, _ROWS_PER_PERSON),
        _errors(AlreadyExists, BudgetExceeded, NotFound, PermissionDenied),
        "RegisterPlan", "RegisterPlanRequest", "Plan",
        # The jobs are planned from the training config (its `runs` copies) as dpfleet train plans it.
        Command(("plan", "register"), {"plan": "name"}, {
            "delta": ("delta",),
            "dataset": ("dataset_name", "config"), "jobs": ("config", "runs"), "privacy_unit": ("config",),
            "rows_per_person": ("config",),
        }),
    ),
    Operation(
        "list_plans", (Parameter("dataset"),), _errors(NotFound, PermissionDenied),
        "ListPlans", "ListPlansRequest", "ListPlansReply",
        Command(("plan", "list"), {"dataset": "dataset"}),
    ),
    Operation(
        "commit", (Parameter("reservation_id"), Parameter("steps"), Parameter("sequence")),
        _errors(BudgetExceeded, NotFound, PermissionDenied),
        "Commit", "CommitRequest", "CommitReply",
    ),
    Operation(
        "release", (Parameter("reservation_id"),), _errors(NotFound, PermissionDenied),
        "Release", "ReleaseRequest", "Reservation",
        Command(("release",), {"reservation_id": "reservation_id"}),
    ),
    Operation(
        "add_block",
        (Parameter("dataset"), Parameter("block"), Parameter("epsilon"), Parameter("delta", None),
         Parameter("data", None)),
        _errors(AlreadyExists, NotFound, PermissionDenied),
        "AddBlock", "AddBlockRequest", "DatasetStatus",
        Command(
            ("block", "add"), {"dataset": "dataset", "block": "name", "epsilon": "epsilon", "delta": "delta"},
            {"data": ("files", "rows", "partition", "user_hash", "user_range")},
        ),
    ),
    Operation(
        "bind_content", (Parameter("dataset"), Parameter("content")), _errors(NotFound, PermissionDenied),
        "BindContent", "BindContentRequest", "DatasetStatus",
    ),
    Operation(
        "set_quota",
        (Parameter("dataset"), Parameter("tenant"), Parameter("epsilon"), Parameter("block", None)),
        _errors(NotFound, PermissionDenied),
        "SetQuota", "SetQuotaRequest", "DatasetStatus",
        Command(("quota", "set"), {"dataset": "dataset", "tenant": "tenant", "epsilon": "epsilon", "block": "block"}),
    ),
    Operation(
        "fits", (Parameter("dataset"), _PLAN, _BLOCKS, _PRIVACY_UNIT, _ROWS_PER_PERSON),
        _errors(NotFound, PermissionDenied),
        "Fits", "FitsRequest", "FitsReply",
        # The job is planned from the training config as dpfleet train plans it.
        Command(("fits",), derived={
            "dataset": ("dataset_name", "config"), "planned": ("config",), "blocks": ("config",),
            "privacy_unit": ("config",), "rows_per_person": ("config",),
        }),
    ),
    Operation(
        "enqueue",
        (Parameter("dataset"), Parameter("job_id"), _PLAN, _LEASE, Parameter("priority", 0),
         Parameter("max_wait_seconds", None), _PRIVACY_UNIT, _ROWS_PER_PERSON, _BLOCKS),
        _errors(BudgetExceeded, NotFound, PermissionDenied),
        "Enqueue", "EnqueueRequest", "QueuedJob",
    ),
    Operation(
        "queued_job", (Parameter("queue_id"),), _errors(NotFound, PermissionDenied),
        "GetQueuedJob", "QueuedJobRequest", "QueuedJob",
    ),
    Operation(
        "cancel_queued", (Parameter("queue_id"),), _errors(NotFound, PermissionDenied),
        "CancelQueued", "QueuedJobRequest", "QueuedJob",
        Command(("cancel",), {"queue_id": "queue_id"}),
    ),
    Operation(
        "list_queued", (Parameter("dataset", None), Parameter("state", "queued")), _errors(NotFound, PermissionDenied),
        "ListQueued", "ListQueuedRequest", "ListQueuedReply",
        # `jobs --queued`: the waiting jobs.
        Command(("jobs",), {"dataset": "dataset"}),
    ),
    Operation(
        "history", (Parameter("dataset", None), Parameter("limit", 1000)), _errors(NotFound, PermissionDenied),
        "History", "HistoryRequest", "HistoryReply",
        Command(("history",), {"dataset": "dataset", "limit": "limit"}),
    ),
)

OPERATIONS: dict[str, Operation] = {operation.name: operation for operation in _DECLARED}
