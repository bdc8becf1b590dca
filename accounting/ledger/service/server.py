"""The ledger server: gRPC with its health service, TLS, the lease sweeper, and beside it the page and metrics.

`start_server` opens the ledger and serves it (the servicer in `servicer`,
its callers checked by `auth`); `serve` runs one until SIGTERM or SIGINT.
Requests above `MAX_REQUEST_BYTES` are refused by gRPC itself with
RESOURCE_EXHAUSTED before any handler runs. Each tenant's costly requests
(new RDP curves, Fits) and each token key id's failed authentications are
rate-limited (`accounting.ledger.limits`).

The standard health service (grpc.health.v1) answers SERVING for "" and for
the ledger service, and NOT_SERVING once a graceful stop begins.

Beside it, in the same process, the server may serve a read-only web page
and Prometheus metrics over HTTP (`web`), behind the same tokens.
"""

from __future__ import annotations

import logging
import signal
import ssl
import sys
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from accounting.ledger import ledger_pb2_grpc
from accounting.ledger.caches import compose_plds_in_process, compute_curves_in_processes
from accounting.ledger.databases import is_postgresql
from accounting.ledger.errors import FailedPrecondition, InvalidArgument
from accounting.ledger.limits import (
    AUTH_FAILURE_BURST,
    AUTH_FAILURE_RATE_PER_SECOND,
    CURVE_BURST,
    CURVE_RATE_PER_SECOND,
    TokenBuckets,
)
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.service.auth import Authenticator, check_admin_token
from accounting.ledger.service.metrics import rpc_latency_histogram
from accounting.ledger.service.servicer import SERVICE_NAME, LedgerServicer
from accounting.ledger.service.web import WebServer, start_web
from accounting.ledger.store import HistoryKeySource, Ledger, served_key_placement_problem

LOG = logging.getLogger(__name__)

# Large enough for a plan of MAX_PLAN_RECORDS records many times over; a
# 10 MB request is refused by gRPC before it reaches the ledger.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# How often a server releases the reservations whose lease ran out, besides at every change to their dataset,
# and serves the queues (unlocking over time, deadlines).
LEASE_SWEEP_SECONDS = 1.0


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
    history_key_file: str | Path | HistoryKeySource | None = None,
    allow_key_beside_database: bool = False,
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
    `history_key_file` is the history key, a file's path or a HistoryKeySource (default:
    store.default_history_key_path(), created if missing); every server of one database needs the same. A key
    file in the SQLite file's folder, or the default one, is refused unless `allow_key_beside_database`, and a
    ledger on PostgreSQL needs its key named (store.served_key_placement_problem).
    Each tenant's costly requests take from a bucket of `curve_burst` that
    refills at `curve_rate_per_second` (one per new RDP curve, and one more
    per Fits); each token key id's failed authentications from one of
    `auth_failure_burst` refilled at `auth_failure_rate_per_second` (see `limits`).
    """
    admin_token = check_admin_token(admin_token)
    curve_limits = TokenBuckets(curve_rate_per_second, curve_burst, "costly requests (new RDP curves, Fits)")
    auth_failures = TokenBuckets(auth_failure_rate_per_second, auth_failure_burst, "failed authentications")
    if (tls_cert is None) != (tls_key is None):
        raise InvalidArgument("TLS needs both a certificate and its key (--tls-cert and --tls-key), or neither")
    _check_key_placement(db_path, history_key_file, allow_key_beside_database)
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
    authenticator = Authenticator(ledger, auth_failures)
    servicer = LedgerServicer(ledger, rpc_latency_histogram(metrics_registry), authenticator)
    ledger_pb2_grpc.add_LedgerServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    try:
        bound = _listen(server, host, port, tls_cert, tls_key)
    except BaseException:
        ledger.close()
        raise
    web_server = None
    if http_port is not None or metrics_port is not None:
        try:
            web_server = start_web(
                ledger, authenticator.authenticate, metrics_registry, host, http_port,
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


def _check_key_placement(
    db_path: str | Path, history_key_file: str | Path | HistoryKeySource | None, allow_key_beside_database: bool
) -> None:
    """Refuse to serve with the history key where the database's writer reads it (served_key_placement_problem)."""
    placement = served_key_placement_problem(
        history_key_file, db_path, is_postgresql(str(db_path)), allow_key_beside_database
    )
    if placement is not None:
        raise FailedPrecondition(f"the ledger server does not start: {placement}")


def _listen(server: grpc.Server, host: str, port: int, tls_cert: str | Path | None, tls_key: str | Path | None) -> int:
    """Add the gRPC port (TLS with a certificate and key); the port bound, or OSError when none could be."""
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
        raise OSError(f"cannot listen on {bind}; is the port in use? Choose another --port (0 picks a free one)")
    return bound


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
    history_key_file: str | Path | HistoryKeySource | None = None,
    allow_key_beside_database: bool = False,
    curve_processes: int = 1,
    **rate_limits: float,
) -> None:
    """Serve the ledger until SIGTERM or SIGINT, then stop gracefully. Call from the main thread.

    `announce` is called with the running server once it accepts requests.
    `history_key_file` and `allow_key_beside_database` are start_server's.
    `http_port` and `metrics_port` serve the web page and metrics, `rate_limits` are
    the rate limits by `start_server`'s names (see there). RDP curves are computed in
    `curve_processes` processes of their own, and budgets' PLDs in one more with a
    deadline (0: both in the server's threads), so that one tenant's new mechanisms
    or long compositions do not hold the GIL that every request needs.
    """
    _check_key_placement(db_path, history_key_file, allow_key_beside_database)  # before any process starts
    if curve_processes:
        compute_curves_in_processes(curve_processes)
        compose_plds_in_process()
    previous_switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)
    running = start_server(
        db_path, host, port, admin_token, tls_cert, tls_key, http_port=http_port, metrics_port=metrics_port,
        scheduling=scheduling, history_key_file=history_key_file, allow_key_beside_database=allow_key_beside_database,
        **rate_limits,
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
