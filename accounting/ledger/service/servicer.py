"""The Ledger gRPC service: each RPC authenticated, handed to the embedded `Ledger`, its errors made status codes.

Ledger errors become status codes (see `messages.STATUS_CODES`); a refusal
for budget also carries the remaining and needed epsilon as trailing
metadata, so a client can rebuild `BudgetExceeded` exactly, and a refusal
for rate when to retry. Every RPC's duration goes to the server's latency
histogram (`metrics.rpc_latency_histogram`). Which request field is which
`Ledger` parameter is declared in `accounting.ledger.operations`.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import grpc
from prometheus_client import Histogram

from accounting.ledger import ledger_pb2 as pb
from accounting.ledger import ledger_pb2_grpc
from accounting.ledger import messages
from accounting.ledger.admission import parse_plan
from accounting.ledger.callers import Caller
from accounting.ledger.errors import BudgetExceeded, InvalidArgument, LedgerError, RateLimited
from accounting.ledger.messages import (
    BUDGET_KEY,
    DATASET_KEY,
    DELTA_KEY,
    NEEDED_EPSILON_KEY,
    REMAINING_EPSILON_KEY,
    RETRY_AFTER_KEY,
    STATUS_CODES,
)
from accounting.ledger.operations import OPERATIONS
from accounting.ledger.service.auth import Authenticator
from accounting.ledger.store import Ledger
from accounting.ledger.validation import EXAMPLE

LOG = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Ledger"].full_name
# An empty limit in a HistoryRequest asks for the operation's default.
DEFAULT_HISTORY_LIMIT = OPERATIONS["history"].default("limit")


def refusal_status(error: LedgerError) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """The status code of a ledger error and the trailing metadata the client rebuilds it from (`client._ledger_error`).

    A refusal for budget carries the remaining and needed epsilon, δ, the dataset
    and which budget refused; a refusal for rate when to retry.
    """
    if isinstance(error, BudgetExceeded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, (
            (REMAINING_EPSILON_KEY, repr(error.remaining_epsilon)),
            (NEEDED_EPSILON_KEY, repr(error.needed_epsilon)),
            (DELTA_KEY, repr(error.delta)),
            (DATASET_KEY, error.dataset),
            (BUDGET_KEY, error.budget),
        )
    if isinstance(error, RateLimited):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, ((RETRY_AFTER_KEY, repr(error.retry_after_seconds)),)
    return STATUS_CODES.get(type(error), grpc.StatusCode.UNKNOWN), ()


def _rpc(method: Callable) -> Callable:
    """Authenticate, call the ledger, turn a LedgerError into its status code, and time the call."""

    @functools.wraps(method)
    def handler(self: "LedgerServicer", request: object, context: grpc.ServicerContext) -> object:
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return method(self, request, self.caller(context))
        except LedgerError as error:
            code, trailers = refusal_status(error)
            if trailers:
                context.set_trailing_metadata(trailers)
            context.abort(code, str(error))
        except Exception:  # noqa: BLE001 - a client gets a status, the log gets the traceback
            LOG.exception("ledger request %s failed", method.__name__)
            code = grpc.StatusCode.INTERNAL
            context.abort(code, "the ledger server failed on this request; see its log")
        finally:
            self.rpc_seconds.labels(method.__name__, code.name).observe(time.perf_counter() - started)

    return handler


class LedgerServicer(ledger_pb2_grpc.LedgerServicer):
    """The Ledger gRPC service over one `Ledger`."""

    def __init__(self, ledger: Ledger, rpc_seconds: Histogram, authenticator: Authenticator) -> None:
        self._ledger = ledger
        self.rpc_seconds = rpc_seconds
        self._authenticator = authenticator

    def caller(self, context: grpc.ServicerContext) -> Caller:
        """Who sent the request, from its bearer token (see `auth.Authenticator`)."""
        return self._authenticator.caller(context.invocation_metadata())

    @_rpc
    def RotateToken(self, request: pb.RotateTokenRequest, caller: Caller) -> pb.CreateTenantReply:
        """Replace a tenant's token, or the caller's admin token, with a new one shown once."""
        if request.admin == bool(request.tenant):
            raise InvalidArgument("name a tenant, or ask for the admin token with admin = true (got both or neither)")
        return messages.tenant_to_proto(self._ledger.rotate_token(request.tenant or None, caller=caller))

    @_rpc
    def RevokeToken(self, request: pb.RevokeTokenRequest, caller: Caller) -> pb.RevokeTokenReply:
        """Revoke a tenant's token or an admin token (admin)."""
        key_id = self._ledger.revoke_token(request.tenant or None, request.admin_key_id or None, caller=caller)
        return pb.RevokeTokenReply(key_id=key_id)

    @_rpc
    def CreateTenant(self, request: pb.CreateTenantRequest, caller: Caller) -> pb.CreateTenantReply:
        """Create a tenant (admin)."""
        return messages.tenant_to_proto(self._ledger.create_tenant(request.tenant, caller=caller))

    @_rpc
    def CreateDataset(self, request: pb.CreateDatasetRequest, caller: Caller) -> pb.DatasetStatus:
        """Create a dataset with its budget."""
        scheduling = messages.scheduling_from_proto(request.scheduling)
        return messages.status_to_proto(
            self._ledger.create_dataset(
                request.dataset, request.epsilon, request.delta, request.privacy_unit or EXAMPLE, scheduling,
                request.plan_share, caller=caller,
            )
        )

    @_rpc
    def RaiseBudget(self, request: pb.RaiseBudgetRequest, caller: Caller) -> pb.DatasetStatus:
        """Set a dataset's budget epsilon (admin)."""
        return messages.status_to_proto(self._ledger.raise_budget(request.dataset, request.epsilon, caller=caller))

    @_rpc
    def GetBudget(self, request: pb.GetBudgetRequest, caller: Caller) -> pb.DatasetStatus:
        """One dataset's status."""
        status = self._ledger.get_budget(request.dataset, request.pld_may_be_pending, caller=caller)
        return messages.status_to_proto(status)

    @_rpc
    def ListDatasets(self, request: pb.ListDatasetsRequest, caller: Caller) -> pb.ListDatasetsReply:
        """Every dataset the caller may see."""
        statuses = self._ledger.list_datasets(request.pld_may_be_pending, caller=caller)
        return pb.ListDatasetsReply(datasets=[messages.status_to_proto(status) for status in statuses])

    @_rpc
    def ListJobs(self, request: pb.ListJobsRequest, caller: Caller) -> pb.ListJobsReply:
        """Reservations on the caller's datasets."""
        state = messages.state_from_proto(request.state)
        jobs = self._ledger.list_jobs(request.dataset or None, state, request.charges, caller=caller)
        return pb.ListJobsReply(jobs=[messages.reservation_to_proto(job) for job in jobs])

    @_rpc
    def Reserve(self, request: pb.ReserveRequest, caller: Caller) -> pb.Reservation:
        """Hold budget for a job's plan, with a lease when lease_seconds > 0."""
        planned = parse_plan(request.planned_events_json)
        reservation = self._ledger.reserve(
            request.dataset, request.job_id, planned, request.lease_seconds or None,
            request.privacy_unit or EXAMPLE, request.rows_per_person or None, tuple(request.blocks),
            request.plan or None, caller=caller,
        )
        return messages.reservation_to_proto(reservation)

    @_rpc
    def RegisterPlan(self, request: pb.RegisterPlanRequest, caller: Caller) -> pb.Plan:
        """Pre-register a plan of jobs, charged its PLD epsilon from the dataset's plan pool (its owner)."""
        plan = self._ledger.register_plan(
            request.dataset, request.plan, [parse_plan(job) for job in request.jobs_json], request.delta or None,
            request.privacy_unit or EXAMPLE, request.rows_per_person or None, caller=caller,
        )
        return messages.plan_to_proto(plan)

    @_rpc
    def ListPlans(self, request: pb.ListPlansRequest, caller: Caller) -> pb.ListPlansReply:
        """The dataset's pre-registered plans the caller may see."""
        plans = self._ledger.list_plans(request.dataset, caller=caller)
        return pb.ListPlansReply(plans=[messages.plan_to_proto(plan) for plan in plans])

    @_rpc
    def Commit(self, request: pb.CommitRequest, caller: Caller) -> pb.CommitReply:
        """Charge a block of steps, idempotently per sequence; renews the reservation's lease."""
        result = self._ledger.commit(request.reservation_id, request.steps, request.sequence, caller=caller)
        return messages.commit_to_proto(result)

    @_rpc
    def Release(self, request: pb.ReleaseRequest, caller: Caller) -> pb.Reservation:
        """Free a reservation's unrun steps."""
        return messages.reservation_to_proto(self._ledger.release(request.reservation_id, caller=caller))

    @_rpc
    def AddBlock(self, request: pb.AddBlockRequest, caller: Caller) -> pb.DatasetStatus:
        """Add a block with its own budget to a dataset (its owner or an admin)."""
        status = self._ledger.add_block(
            request.dataset, request.block, request.epsilon, request.delta or None, request.data or None,
            caller=caller,
        )
        return messages.status_to_proto(status)

    @_rpc
    def BindContent(self, request: pb.BindContentRequest, caller: Caller) -> pb.DatasetStatus:
        """Bind a job's files to a dataset on first use, or check they are its own (owner or admin)."""
        return messages.status_to_proto(self._ledger.bind_content(request.dataset, list(request.content), caller=caller))

    @_rpc
    def SetQuota(self, request: pb.SetQuotaRequest, caller: Caller) -> pb.DatasetStatus:
        """Give a tenant a quota on a dataset or one of its blocks (admin)."""
        status = self._ledger.set_quota(
            request.dataset, request.tenant, request.epsilon, request.block or None, caller=caller
        )
        return messages.status_to_proto(status)

    @_rpc
    def Fits(self, request: pb.FitsRequest, caller: Caller) -> pb.FitsReply:
        """Whether a job would be admitted now, and at what cost; reserves nothing."""
        self._ledger.refuse_while_limited(caller)
        planned = parse_plan(request.planned_events_json)
        report = self._ledger.fits(
            request.dataset, planned, tuple(request.blocks), request.privacy_unit or EXAMPLE,
            request.rows_per_person or None, caller=caller,
        )
        return messages.fit_to_proto(report)

    @_rpc
    def Enqueue(self, request: pb.EnqueueRequest, caller: Caller) -> pb.QueuedJob:
        """Queue a job for budget; admitted at once when its dataset's policy finds it fits."""
        queued = self._ledger.enqueue(
            request.dataset, request.job_id, parse_plan(request.planned_events_json), request.lease_seconds or None,
            request.priority, request.max_wait_seconds or None, request.privacy_unit or EXAMPLE,
            request.rows_per_person or None, tuple(request.blocks), caller=caller,
        )
        return messages.queued_to_proto(queued)

    @_rpc
    def GetQueuedJob(self, request: pb.QueuedJobRequest, caller: Caller) -> pb.QueuedJob:
        """A queued job as it stands now."""
        return messages.queued_to_proto(self._ledger.queued_job(request.queue_id, caller=caller))

    @_rpc
    def CancelQueued(self, request: pb.QueuedJobRequest, caller: Caller) -> pb.QueuedJob:
        """Take a waiting job out of the queue."""
        return messages.queued_to_proto(self._ledger.cancel_queued(request.queue_id, caller=caller))

    @_rpc
    def ListQueued(self, request: pb.ListQueuedRequest, caller: Caller) -> pb.ListQueuedReply:
        """Queued jobs on the caller's datasets, of one state or any."""
        jobs = self._ledger.list_queued(request.dataset or None, request.state or None, caller=caller)
        return pb.ListQueuedReply(jobs=[messages.queued_to_proto(job) for job in jobs])

    @_rpc
    def History(self, request: pb.HistoryRequest, caller: Caller) -> pb.HistoryReply:
        """The newest changes the caller may see."""
        entries = self._ledger.history(request.dataset or None, request.limit or DEFAULT_HISTORY_LIMIT, caller=caller)
        return pb.HistoryReply(entries=[messages.history_to_proto(entry) for entry in entries])
