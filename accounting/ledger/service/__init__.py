"""The ledger server: the gRPC servicer, its auth, start and serve, and the read-only page and metrics beside it.

- `servicer`: the Ledger gRPC service over one embedded `Ledger`, and the status code of each ledger error.
- `auth`: who sent a request (its bearer token, each token key id's failed tries), and the admin token's check.
- `server`: `start_server` and `serve`: gRPC, health, TLS and the lease sweeper.
- `web`, `view`, `metrics` and `page/`: the HTTP side, what the page shows, the Prometheus metrics.

The names below load their module (gRPC, aiohttp, prometheus) on first use, so that importing the
package costs nothing.
"""

from accounting.lazy import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "auth": ["Authenticator", "MIN_ADMIN_TOKEN_LENGTH", "bearer_token", "check_admin_token"],
    "metrics": ["BLOCK_GAUGES", "DATASET_GAUGES", "QUOTA_GAUGES", "RPC_SECONDS", "exposition",
                "rpc_latency_histogram"],
    "server": ["GIL_SWITCH_INTERVAL_SECONDS", "LEASE_SWEEP_SECONDS", "LedgerServer", "MAX_REQUEST_BYTES", "serve",
               "start_server"],
    "servicer": ["DEFAULT_HISTORY_LIMIT", "SERVICE_NAME", "LedgerServicer", "refusal_status"],
    "view": ["ledger_view"],
    "web": ["TOKEN_COOKIE", "WebServer", "start_web"],
})
