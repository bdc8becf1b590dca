"""`RemoteLedger`: the ledger server through the same interface as the embedded `Ledger`.

Each call is one RPC with a deadline. Given several servers of one database
("a:1,b:2"), a call that one of them does not answer (UNAVAILABLE or
DEADLINE_EXCEEDED) is sent to the next, and the client stays with the one
that answered. That retry is safe for the calls a job makes: a reserve with
the same job id and plan holds budget once, a commit with the same sequence
is charged once, a release frees once. Beyond that the caller decides whether
to retry. Status codes come back as the core's exceptions; a call that no
server answered becomes LedgerUnavailable.
"""

from __future__ import annotations

import json
from pathlib import Path
import grpc

from accounting.events import EventsLike
from accounting.ledger import ledger_pb2 as pb
from accounting.ledger import ledger_pb2_grpc
from accounting.ledger import messages
from accounting.ledger.admission import FitReport, check_plan, check_plan_share
from accounting.ledger.errors import BudgetExceeded, InvalidArgument, LedgerError, LedgerUnavailable, RateLimited
from accounting.ledger.records import (
    CommitResult, DatasetStatus, HistoryEntry, PlanStatus, QueuedJob, Reservation, TenantCreated,
)
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.messages import (
    BUDGET_KEY,
    DATASET_KEY,
    DELTA_KEY,
    NEEDED_EPSILON_KEY,
    REMAINING_EPSILON_KEY,
    RETRY_AFTER_KEY,
    STATUS_CODES,
)
from accounting.ledger.validation import (
    EXAMPLE,
    check_block_names,
    check_delta,
    check_history_limit,
    check_lease_seconds,
    check_max_wait_seconds,
    check_priority,
    check_privacy_unit,
    check_queue_state,
    check_rows_per_person,
    check_scheduling,
    check_sequence,
    check_steps,
)

_ERRORS_BY_CODE = {code: error for error, code in STATUS_CODES.items() if error is not BudgetExceeded}
# History and job lists can be long; requests stay small.
_MAX_REPLY_BYTES = 256 * 1024 * 1024


def _ledger_error(address: str, error: grpc.RpcError) -> LedgerError:
    """The core exception for a failed RPC."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        trailers = dict(error.trailing_metadata() or ())
        if REMAINING_EPSILON_KEY in trailers:
            return BudgetExceeded(
                trailers[DATASET_KEY],
                float(trailers[REMAINING_EPSILON_KEY]),
                float(trailers[NEEDED_EPSILON_KEY]),
                float(trailers[DELTA_KEY]),
                trailers.get(BUDGET_KEY),
            )
        if RETRY_AFTER_KEY in trailers:
            return RateLimited(details, float(trailers[RETRY_AFTER_KEY]))
        return InvalidArgument(f"the ledger at {address} refused the request as too large: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return LedgerUnavailable(
            f"the ledger at {address} did not answer ({code.name}: {details}); "
            "check that dpfleet ledger serve runs there and the address is right"
        )
    error_class = _ERRORS_BY_CODE.get(code, LedgerError)
    return error_class(details if error_class is not LedgerError else f"{code.name}: {details}")


def _optional_field(name: str, value: object) -> object:
    """An optional argument as its request field, which reads its zero ("" or 0) as "not given": None is that zero.

    Any other value must not be the zero itself: the embedded Ledger refuses
    an empty name or a zero delta, and the server must not take one for None.
    """
    if value is None or value:
        return value
    raise InvalidArgument(f"{name} must not be empty or zero (got {value!r}); leave it out (None) for its default")


def parse_addresses(address: str) -> list[str]:
    """The HOST:PORT entries of "a:1,b:2" (servers of one ledger database), in order."""
    addresses = [part.strip() for part in address.split(",") if part.strip()]
    if not addresses or any(":" not in part for part in addresses):
        raise InvalidArgument(
            f"ledger address must be HOST:PORT, or several separated by commas (got {address!r})"
        )
    return addresses


class RemoteLedger:
    """A client of `dpfleet ledger serve` with the methods of the embedded `Ledger`.

    `address` is host:port, or several separated by commas for servers of
    one PostgreSQL ledger (a call that one does not answer goes to the
    next); `token` a tenant or admin token; `tls_ca` a PEM file of the CA
    that signed the servers' certificate (None: plaintext);
    `timeout_seconds` the deadline of each call.
    """

    def __init__(
        self,
        address: str,
        token: str,
        tls_ca: str | Path | None = None,
        timeout_seconds: float = 10.0,
    ) -> None:
        self.address = address
        self.timeout_seconds = timeout_seconds
        self._metadata = (("authorization", f"Bearer {token}"),)
        options = [("grpc.max_receive_message_length", _MAX_REPLY_BYTES)]
        credentials = None if tls_ca is None else grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
        self._addresses = parse_addresses(address)
        self._channels = [
            grpc.insecure_channel(server, options=options)
            if credentials is None
            else grpc.secure_channel(server, credentials, options=options)
            for server in self._addresses
        ]
        self._stubs = [ledger_pb2_grpc.LedgerStub(channel) for channel in self._channels]
        self._current = 0

    def __enter__(self) -> "RemoteLedger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channels."""
        for channel in self._channels:
            channel.close()

    @staticmethod
    def _request(message_class: type, **fields: object) -> object:
        try:
            return message_class(**fields)
        except (TypeError, ValueError) as error:
            raise InvalidArgument(f"{message_class.__name__}: {error}; check the arguments' types") from None

    def _call(self, method: str, request: object) -> object:
        """Call `method` on the current server, then on each other one while none answers."""
        unanswered = None
        for attempt in range(len(self._stubs)):
            server = (self._current + attempt) % len(self._stubs)
            try:
                reply = getattr(self._stubs[server], method)(
                    request, timeout=self.timeout_seconds, metadata=self._metadata
                )
            except grpc.RpcError as error:
                failure = _ledger_error(self._addresses[server], error)
                if not isinstance(failure, LedgerUnavailable):
                    raise failure from None
                unanswered = failure
                continue
            self._current = server
            return reply
        raise unanswered

    def create_tenant(self, tenant: str) -> TenantCreated:
        """Create a tenant and return its token, shown this once (admin token only)."""
        reply = self._call("CreateTenant", self._request(pb.CreateTenantRequest, tenant=tenant))
        return messages.tenant_from_proto(reply)

    def rotate_token(self, tenant: str | None = None) -> TenantCreated:
        """A new token for `tenant` (None: the admin token of this client), shown once; the old one stops working."""
        request = self._request(pb.RotateTokenRequest, tenant=tenant or "", admin=tenant is None)
        return messages.tenant_from_proto(self._call("RotateToken", request))

    def revoke_token(self, tenant: str | None = None, key_id: str | None = None) -> str:
        """Revoke a tenant's token, or the admin token of `key_id` (admin only); the revoked key id."""
        request = self._request(
            pb.RevokeTokenRequest, tenant=_optional_field("tenant", tenant) or "",
            admin_key_id=_optional_field("key_id", key_id) or "",
        )
        return self._call("RevokeToken", request).key_id

    def create_dataset(
        self, dataset: str, epsilon: float, delta: float, privacy_unit: str = EXAMPLE,
        scheduling: SchedulingPolicy | dict | None = None, plan_share: float = 0.0,
    ) -> DatasetStatus:
        """Create a dataset with a budget of `epsilon` at `delta` per `privacy_unit` ('example' or 'user').

        `scheduling` serves its queue of waiting jobs (None: the server's default); `plan_share` of the budget
        is set aside as its plan pool (see the embedded Ledger.create_dataset).
        """
        policy = check_scheduling(scheduling) if scheduling is not None else None
        request = self._request(
            pb.CreateDatasetRequest, dataset=dataset, epsilon=epsilon, delta=delta,
            privacy_unit=check_privacy_unit(privacy_unit), scheduling=messages.scheduling_to_proto(policy),
            plan_share=check_plan_share(plan_share),
        )
        return messages.status_from_proto(self._call("CreateDataset", request))

    def raise_budget(self, dataset: str, epsilon: float) -> DatasetStatus:
        """Set a dataset's budget epsilon (admin token only)."""
        request = self._request(pb.RaiseBudgetRequest, dataset=dataset, epsilon=epsilon)
        return messages.status_from_proto(self._call("RaiseBudget", request))

    def get_budget(self, dataset: str, pld_may_be_pending: bool = False) -> DatasetStatus:
        """One dataset's budget, spent, reserved and remaining epsilon, and its active jobs.

        With `pld_may_be_pending`, the server answers at once, with the RDP
        epsilon as `spent_epsilon` (labelled "rdp") while the PLD epsilon of
        new commits is computed.
        """
        request = self._request(pb.GetBudgetRequest, dataset=dataset, pld_may_be_pending=pld_may_be_pending)
        return messages.status_from_proto(self._call("GetBudget", request))

    def list_datasets(self, pld_may_be_pending: bool = False) -> list[DatasetStatus]:
        """Every dataset the token may see (see get_budget for `pld_may_be_pending`)."""
        request = self._request(pb.ListDatasetsRequest, pld_may_be_pending=pld_may_be_pending)
        reply = self._call("ListDatasets", request)
        return [messages.status_from_proto(status) for status in reply.datasets]

    def list_jobs(
        self, dataset: str | None = None, state: str | None = None, charges: bool = False
    ) -> list[Reservation]:
        """Reservations on the token's datasets, oldest first; optionally of one dataset or state; with `charges`,
        what each took from its budgets (see Ledger.list_jobs)."""
        request = self._request(
            pb.ListJobsRequest, dataset=_optional_field("dataset", dataset) or "", state=messages.state_to_proto(state),
            charges=charges,
        )
        return [messages.reservation_from_proto(job) for job in self._call("ListJobs", request).jobs]

    def reserve(
        self, dataset: str, job_id: str, planned: EventsLike, lease_seconds: float | None = None,
        privacy_unit: str = EXAMPLE, rows_per_person: int | None = None, blocks: tuple[str, ...] | list[str] = (),
        plan: str | None = None,
    ) -> Reservation:
        """Hold budget for a job's planned events, or raise BudgetExceeded; with a lease of `lease_seconds`.

        `privacy_unit` and `rows_per_person` as in the embedded Ledger.reserve. With `blocks`, the job is
        charged in full to each of those blocks of the dataset; with `plan`, it is the next job of that
        pre-registered plan.
        """
        planned_json = check_plan(planned).to_json()
        request = self._request(
            pb.ReserveRequest, dataset=dataset, job_id=job_id, planned_events_json=planned_json,
            lease_seconds=check_lease_seconds(lease_seconds) or 0.0, privacy_unit=check_privacy_unit(privacy_unit),
            rows_per_person=check_rows_per_person(rows_per_person) or 0, blocks=check_block_names(blocks),
            plan=_optional_field("plan", plan) or "",
        )
        return messages.reservation_from_proto(self._call("Reserve", request))

    def register_plan(
        self, dataset: str, plan: str, jobs: list[EventsLike] | tuple[EventsLike, ...], delta: float | None = None,
        privacy_unit: str = EXAMPLE, rows_per_person: int | None = None,
    ) -> PlanStatus:
        """Pre-register a plan of `jobs` (each one's planned events, in order), charged its PLD ε at `delta`
        from the dataset's plan pool now (see the embedded Ledger.register_plan)."""
        if not isinstance(jobs, (list, tuple)):
            raise InvalidArgument("a plan's jobs are a list of planned events")
        request = self._request(
            pb.RegisterPlanRequest, dataset=dataset, plan=plan, jobs_json=[check_plan(job).to_json() for job in jobs],
            delta=_optional_field("delta", delta) or 0.0, privacy_unit=check_privacy_unit(privacy_unit),
            rows_per_person=check_rows_per_person(rows_per_person) or 0,
        )
        return messages.plan_from_proto(self._call("RegisterPlan", request))

    def list_plans(self, dataset: str) -> list[PlanStatus]:
        """The dataset's pre-registered plans the caller may see, oldest first."""
        reply = self._call("ListPlans", self._request(pb.ListPlansRequest, dataset=dataset))
        return [messages.plan_from_proto(plan) for plan in reply.plans]

    def add_block(
        self, dataset: str, block: str, epsilon: float, delta: float | None = None, data: dict | str | None = None
    ) -> DatasetStatus:
        """Add a block with its own budget of `epsilon` at `delta` (default: the dataset's) to a dataset,
        bound to the rows `data` declares (see admission.check_block_data; the server checks it)."""
        data = _optional_field("data", data)
        request = self._request(
            pb.AddBlockRequest, dataset=dataset, block=block, epsilon=epsilon,
            delta=check_delta(delta) if delta is not None else 0.0,
            data=data if isinstance(data, str) else json.dumps(data) if data is not None else "",
        )
        return messages.status_from_proto(self._call("AddBlock", request))

    def bind_content(self, dataset: str, content: list[str]) -> DatasetStatus:
        """Bind the SHA-256s of the files a job reads to a dataset on first use, or check they are among its own
        (see the store's `bind_content`)."""
        request = self._request(pb.BindContentRequest, dataset=dataset, content=list(content))
        return messages.status_from_proto(self._call("BindContent", request))

    def set_quota(self, dataset: str, tenant: str, epsilon: float, block: str | None = None) -> DatasetStatus:
        """Give `tenant` a quota of `epsilon` on a dataset or one of its blocks (admin token only)."""
        request = self._request(
            pb.SetQuotaRequest, dataset=dataset, tenant=tenant, epsilon=epsilon,
            block=_optional_field("block", block) or "",
        )
        return messages.status_from_proto(self._call("SetQuota", request))

    def fits(
        self, dataset: str, planned: EventsLike, blocks: tuple[str, ...] | list[str] = (),
        privacy_unit: str = EXAMPLE, rows_per_person: int | None = None,
    ) -> FitReport:
        """Whether a job would be admitted now, what it would cost and what would remain; reserves nothing."""
        request = self._request(
            pb.FitsRequest, dataset=dataset, planned_events_json=check_plan(planned).to_json(),
            blocks=check_block_names(blocks), privacy_unit=check_privacy_unit(privacy_unit),
            rows_per_person=check_rows_per_person(rows_per_person) or 0,
        )
        return messages.fit_from_proto(self._call("Fits", request))

    def commit(self, reservation_id: str, steps: int, sequence: int) -> CommitResult:
        """Charge the next `steps` planned steps; the same `sequence` twice charges once."""
        request = self._request(
            pb.CommitRequest, reservation_id=reservation_id, steps=check_steps(steps), sequence=check_sequence(sequence)
        )
        return messages.commit_from_proto(self._call("Commit", request))

    def release(self, reservation_id: str) -> Reservation:
        """Free the reservation's unrun steps; committed steps stay spent."""
        request = self._request(pb.ReleaseRequest, reservation_id=reservation_id)
        return messages.reservation_from_proto(self._call("Release", request))

    def history(self, dataset: str | None = None, limit: int = 1000) -> list[HistoryEntry]:
        """The newest `limit` changes the token may see, oldest first."""
        request = self._request(
            pb.HistoryRequest, dataset=_optional_field("dataset", dataset) or "", limit=check_history_limit(limit)
        )
        return [messages.history_from_proto(entry) for entry in self._call("History", request).entries]

    def enqueue(
        self,
        dataset: str,
        job_id: str,
        planned: EventsLike,
        lease_seconds: float | None = None,
        priority: int = 0,
        max_wait_seconds: float | None = None,
        privacy_unit: str = EXAMPLE,
        rows_per_person: int | None = None,
        blocks: tuple[str, ...] | list[str] = (),
    ) -> QueuedJob:
        """Queue a job for budget; admitted when the dataset's policy finds it fits (see Ledger.enqueue)."""
        request = self._request(
            pb.EnqueueRequest, dataset=dataset, job_id=job_id, planned_events_json=check_plan(planned).to_json(),
            lease_seconds=check_lease_seconds(lease_seconds) or 0.0, priority=check_priority(priority),
            max_wait_seconds=check_max_wait_seconds(max_wait_seconds) or 0.0,
            privacy_unit=check_privacy_unit(privacy_unit), rows_per_person=check_rows_per_person(rows_per_person) or 0,
            blocks=list(check_block_names(blocks)),
        )
        return messages.queued_from_proto(self._call("Enqueue", request))

    def queued_job(self, queue_id: str) -> QueuedJob:
        """A queued job as it stands now: waiting (position, reason), admitted (reservation), cancelled, timed out."""
        request = self._request(pb.QueuedJobRequest, queue_id=queue_id)
        return messages.queued_from_proto(self._call("GetQueuedJob", request))

    def cancel_queued(self, queue_id: str) -> QueuedJob:
        """Take a waiting job out of the queue (an admitted one holds a reservation: release it)."""
        request = self._request(pb.QueuedJobRequest, queue_id=queue_id)
        return messages.queued_from_proto(self._call("CancelQueued", request))

    def list_queued(self, dataset: str | None = None, state: str | None = "queued") -> list[QueuedJob]:
        """Queued jobs on the token's datasets (waiting ones by default; None: any state)."""
        request = self._request(
            pb.ListQueuedRequest, dataset=_optional_field("dataset", dataset) or "",
            state=check_queue_state(state) or "",
        )
        return [messages.queued_from_proto(job) for job in self._call("ListQueued", request).jobs]
