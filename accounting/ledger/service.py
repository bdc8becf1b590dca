"""The ledger's gRPC server: a thin adapter from RPCs to the embedded `Ledger`.

Authentication is a bearer token in the `authorization` metadata: an admin
token (the one the server was started with, or one rotated in) or a tenant
token, all kept by the ledger (`Ledger.authenticate`). A peer address whose
authentications keep failing is refused for a while without a look at its
tokens (RESOURCE_EXHAUSTED with a retry hint), and each tenant's costly
requests (new RDP curves, Fits) are rate-limited (`limits`). Ledger errors become
status codes (see `messages.STATUS_CODES`); a refusal for budget also carries the
remaining and needed epsilon as trailing metadata, so a client can rebuild
`BudgetExceeded` exactly. Requests above `MAX_REQUEST_BYTES` are refused by
gRPC itself with RESOURCE_EXHAUSTED before any handler runs.

The standard health service (grpc.health.v1) answers SERVING for "" and for
the ledger service, and NOT_SERVING once a graceful stop begins.

Beside it, in the same process, the server may serve a read-only web page
and Prometheus metrics over HTTP (`accounting.ledger.web`), behind the same
tokens; every RPC's duration goes to the metrics' latency histogram.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import ssl
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Histogram

from accounting.ledger import ledger_pb2 as pb
from accounting.ledger import ledger_pb2_grpc
from accounting.ledger import messages
from accounting.ledger.admission import parse_plan
from accounting.ledger.caches import compute_curves_in_processes
from accounting.ledger.callers import Caller
from accounting.ledger.errors import BudgetExceeded, InvalidArgument, LedgerError, RateLimited, Unauthenticated
from accounting.ledger.messages import (
    BUDGET_KEY,
    DATASET_KEY,
    DELTA_KEY,
    NEEDED_EPSILON_KEY,
    REMAINING_EPSILON_KEY,
    RETRY_AFTER_KEY,
    STATUS_CODES,
)
from accounting.ledger.limits import (
    AUTH_FAILURE_BURST,
    AUTH_FAILURE_RATE_PER_SECOND,
    CURVE_BURST,
    CURVE_RATE_PER_SECOND,
    TokenBuckets,
)
from accounting.ledger.metrics import rpc_latency_histogram
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.store import Ledger
from accounting.ledger.validation import EXAMPLE
from accounting.ledger.web import WebServer, start_web

LOG = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Ledger"].full_name
# Large enough for a plan of MAX_PLAN_RECORDS records many times over; a
# 10 MB request is refused by gRPC before it reaches the ledger.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_HISTORY_LIMIT = 1000
MIN_ADMIN_TOKEN_LENGTH = 16
# How often a server releases the reservations whose lease ran out, besides at every change to their dataset,
# and serves the queues (unlocking over time, deadlines).
LEASE_SWEEP_SECONDS = 1.0

def bearer_token(metadata: tuple) -> str | None:
    """The token of an `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def peer_address(peer: str) -> str:
    """The address of a gRPC peer ("ipv4:127.0.0.1:5000" -> "127.0.0.1"), without its port."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition("]")[0].lstrip("[") or rest
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    return peer


def _rpc(method: Callable) -> Callable:
    """Authenticate, call the ledger, turn a LedgerError into its status code, and time the call."""

    @functools.wraps(method)
    def handler(self: "LedgerServicer", request: object, context: grpc.ServicerContext) -> object:
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return method(self, request, self.caller(context))
        except BudgetExceeded as error:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            context.set_trailing_metadata(
                (
                    (REMAINING_EPSILON_KEY, repr(error.remaining_epsilon)),
                    (NEEDED_EPSILON_KEY, repr(error.needed_epsilon)),
                    (DELTA_KEY, repr(error.delta)),
                    (DATASET_KEY, error.dataset),
                    (BUDGET_KEY, error.budget),
                )
            )
            context.abort(code, str(error))
        except RateLimited as error:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            context.set_trailing_metadata(((RETRY_AFTER_KEY, repr(error.retry_after_seconds)),))
            context.abort(code, str(error))
        except LedgerError as error:
            code = STATUS_CODES.get(type(error), grpc.StatusCode.UNKNOWN)
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

    def __init__(self, ledger: Ledger, rpc_seconds: Histogram, auth_failures: TokenBuckets) -> None:
        self._ledger = ledger
        self.rpc_seconds = rpc_seconds
        self._auth_failures = auth_failures

    def caller(self, context: grpc.ServicerContext) -> Caller:
        """Who sent the request, from its bearer token.

        A token verified lately passes at once. Otherwise a peer that has
        used up its failed authentications is refused before its token is
        looked at, and each failure is counted against it.
        """
        token = bearer_token(context.invocation_metadata())
        if token is not None:
            known = self._ledger.verified_caller(token)
            if known is not None:
                return known
        peer = peer_address(context.peer())
        wait = self._auth_failures.owes(peer)
        if wait > 0:
            raise RateLimited(
                f"too many failed authentications from {peer}: at most {self._auth_failures.burst:g} at once, then "
                f"{self._auth_failures.rate_per_second:g} a second; retry in {wait:.1f} s with a valid token",
                wait,
            )
        try:
            if token is None:
                raise Unauthenticated(
                    "no token: send metadata 'authorization: Bearer <token>' (dpfleet ledger --token or DPFLEET_TOKEN)"
                )
            return self._ledger.authenticate(token)
        except Unauthenticated:
            with contextlib.suppress(RateLimited):
                self._auth_failures.take(peer)
            raise

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
                caller=caller,
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
        jobs = self._ledger.list_jobs(request.dataset or None, state, caller=caller)
        return pb.ListJobsReply(jobs=[messages.reservation_to_proto(job) for job in jobs])

    @_rpc
    def Reserve(self, request: pb.ReserveRequest, caller: Caller) -> pb.Reservation:
        """Hold budget for a job's plan, with a lease when lease_seconds > 0."""
        planned = parse_plan(request.planned_events_json)
        reservation = self._ledger.reserve(
            request.dataset, request.job_id, planned, request.lease_seconds or None,
            request.privacy_unit or EXAMPLE, request.rows_per_person or None, tuple(request.blocks), caller=caller,
        )
        return messages.reservation_to_proto(reservation)

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


@dataclass
class LedgerServer:
    """A running ledger server; `port` is the port actually bound, `web` its page and metrics (None: neither)."""

    server: grpc.Server
    ledger: Ledger
    health: health.HealthServicer
    host: str
    port: int
    stopping: threading.Event
    lease_sweeper: threading.Thread
    web: WebServer | None = None

    @property
    def address(self) -> str:
        """host:port for clients (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def stop(self, grace_seconds: float = 5.0) -> None:
        """Report NOT_SERVING, finish requests in flight (up to the grace period), close the file."""
        self.health.enter_graceful_shutdown()
        if self.web is not None:
            self.web.stop()
        self.server.stop(grace_seconds).wait()
        self.stopping.set()
        self.lease_sweeper.join()
        self.ledger.close()


def check_admin_token(admin_token: str | None) -> str | None:
    """The admin token, refused when too short to resist guessing.

    The ledger keeps it as its SHA-256 digest (tokens.token_digest), which
    protects a random token only: make it with secrets, as the error says.
    """
    if admin_token is not None and len(admin_token) < MIN_ADMIN_TOKEN_LENGTH:
        raise InvalidArgument(
            f"the admin token must be at least {MIN_ADMIN_TOKEN_LENGTH} characters (got {len(admin_token)}); "
            "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return admin_token


def start_server(
    db_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 50051,
    admin_token: str | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    max_workers: int = 16,
    http_port: int | None = None,
    metrics_port: int | None = None,
    scheduling: SchedulingPolicy | None = None,
    history_key_file: str | Path | None = None,
    curve_rate_per_second: float = CURVE_RATE_PER_SECOND,
    curve_burst: float = CURVE_BURST,
    auth_failure_rate_per_second: float = AUTH_FAILURE_RATE_PER_SECOND,
    auth_failure_burst: float = AUTH_FAILURE_BURST,
) -> LedgerServer:
    """Open the ledger (an SQLite file or a postgresql:// URL) and serve it on host:port; returns at once.

    Port 0 picks a free port. With `http_port` the read-only web page is
    served on it, with `metrics_port` Prometheus metrics (see `web`), on the
    same host, behind the same tokens.

    Without `admin_token` no admin RPC can succeed. TLS is used when both
    `tls_cert` and `tls_key` (PEM files) are given, for the page and metrics too.
    `scheduling` is the queue policy of datasets created without one (fcfs by default).
    `history_key_file` is the history key (default: store.default_history_key_path(), created if missing);
    every server of one database needs the same.
    Each tenant's costly requests take from a bucket of `curve_burst` that
    refills at `curve_rate_per_second` (one per new RDP curve, and one more
    per Fits); each peer address's failed authentications from one of
    `auth_failure_burst` refilled at `auth_failure_rate_per_second` (see `limits`).
    """
    admin_token = check_admin_token(admin_token)
    curve_limits = TokenBuckets(curve_rate_per_second, curve_burst, "costly requests (new RDP curves, Fits)")
    auth_failures = TokenBuckets(auth_failure_rate_per_second, auth_failure_burst, "failed authentications")
    if (tls_cert is None) != (tls_key is None):
        raise InvalidArgument("TLS needs both a certificate and its key (--tls-cert and --tls-key), or neither")
    ledger = Ledger(db_path, scheduling=scheduling, history_key_file=history_key_file)
    ledger.curve_limits = curve_limits
    if admin_token is not None:
        try:
            ledger.register_admin_token(admin_token)
        except BaseException:
            ledger.close()
            raise
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ledger"),
        options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES)],
    )
    metrics_registry = CollectorRegistry(auto_describe=True)
    servicer = LedgerServicer(ledger, rpc_latency_histogram(metrics_registry), auth_failures)
    ledger_pb2_grpc.add_LedgerServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls_cert is None:
            bound = server.add_insecure_port(bind)
        else:
            credentials = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
            bound = server.add_secure_port(bind, credentials)
    except RuntimeError:
        bound = 0
    if not bound:
        ledger.close()
        raise OSError(f"cannot listen on {bind}; is the port in use? Choose another --port (0 picks a free one)")
    web_server = None
    if http_port is not None or metrics_port is not None:
        try:
            web_server = start_web(
                ledger, ledger.authenticate, metrics_registry, host, http_port,
                metrics_port, _https_context(tls_cert, tls_key),
            )
        except BaseException:
            server.stop(None)
            ledger.close()
            raise
    server.start()
    stopping = threading.Event()
    sweeper = threading.Thread(target=_sweep_leases, args=(ledger, stopping), name="ledger-leases", daemon=True)
    sweeper.start()
    return LedgerServer(server, ledger, health_servicer, host, bound, stopping, sweeper, web_server)


def _https_context(tls_cert: str | Path | None, tls_key: str | Path | None) -> ssl.SSLContext | None:
    """The page's and metrics' TLS context from the gRPC server's own certificate and key (None: plain HTTP)."""
    if tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls_cert, tls_key)
    return context


def _sweep_leases(ledger: Ledger, stopping: threading.Event) -> None:
    """Release expired leases and serve the queues every LEASE_SWEEP_SECONDS until `stopping` is set."""
    while not stopping.wait(LEASE_SWEEP_SECONDS):
        try:
            ledger.expire_leases()
            ledger.serve_queues()
        except Exception:  # noqa: BLE001 - the next sweep tries again; every change to a dataset sweeps it too
            LOG.exception("releasing expired leases or serving the queues failed")


# A PLD epsilon computing in the background (a status that did not wait for it started it) runs long Python
# loops; the request threads get the GIL back every 0.5 ms instead of Python's default 5 ms. bench/ledger's
# "status after commit, no wait" row: p99 28-31 ms at the default, 12 ms at this one.
GIL_SWITCH_INTERVAL_SECONDS = 0.0005


def serve(
    db_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 50051,
    admin_token: str | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    announce: Callable[[LedgerServer], None] | None = None,
    http_port: int | None = None,
    metrics_port: int | None = None,
    scheduling: SchedulingPolicy | None = None,
    history_key_file: str | Path | None = None,
    curve_processes: int = 1,
    **rate_limits: float,
) -> None:
    """Serve the ledger until SIGTERM or SIGINT, then stop gracefully. Call from the main thread.

    `announce` is called with the running server once it accepts requests.
    `http_port` and `metrics_port` serve the web page and metrics, `rate_limits` are
    the rate limits by `start_server`'s names (see there). RDP curves are computed in
    `curve_processes` processes of their own (0: in the request threads), so that
    one tenant's new mechanisms do not hold the GIL that every request needs.
    """
    if curve_processes:
        compute_curves_in_processes(curve_processes)
    previous_switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)
    running = start_server(
        db_path, host, port, admin_token, tls_cert, tls_key, http_port=http_port, metrics_port=metrics_port,
        scheduling=scheduling, history_key_file=history_key_file, **rate_limits,
    )
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if announce is not None:
            announce(running)
        stop.wait()
    finally:
        running.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.setswitchinterval(previous_switch_interval)
