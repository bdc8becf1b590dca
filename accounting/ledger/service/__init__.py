"""The ledger server: the gRPC servicer, its auth, start and serve, and the read-only page and metrics beside it.

- `servicer`: the Ledger gRPC service over one embedded `Ledger`, and the status code of each ledger error.
- `auth`: who sent a request (its bearer token, its peer's failed tries), and the admin token's check.
- `server`: `start_server` and `serve`: gRPC, health, TLS and the lease sweeper.
- `web`, `view`, `metrics` and `page/`: the HTTP side, what the page shows, the Prometheus metrics.

The names below load their module (gRPC, aiohttp, prometheus) on first use, so that importing the
package costs nothing.
"""

from __future__ import annotations

import importlib

# Each public name and the module of this package that defines it.
_HOMES = {
    "SERVICE_NAME": "servicer",
    "DEFAULT_HISTORY_LIMIT": "servicer",
    "LedgerServicer": "servicer",
    "refusal_status": "servicer",
    "Authenticator": "auth",
    "MIN_ADMIN_TOKEN_LENGTH": "auth",
    "bearer_token": "auth",
    "check_admin_token": "auth",
    "peer_address": "auth",
    "GIL_SWITCH_INTERVAL_SECONDS": "server",
    "LEASE_SWEEP_SECONDS": "server",
    "LedgerServer": "server",
    "MAX_REQUEST_BYTES": "server",
    "serve": "server",
    "start_server": "server",
    "TOKEN_COOKIE": "web",
    "WebServer": "web",
    "start_web": "web",
    "ledger_view": "view",
    "BLOCK_GAUGES": "metrics",
    "DATASET_GAUGES": "metrics",
    "QUOTA_GAUGES": "metrics",
    "RPC_SECONDS": "metrics",
    "exposition": "metrics",
    "rpc_latency_histogram": "metrics",
}

# Modules other code may use whole: `view`'s table lists are where another part of the ledger adds its tables.
_PUBLIC_MODULES = ("view",)

__all__ = sorted([*_HOMES, *_PUBLIC_MODULES])


def __getattr__(name: str) -> object:
    """A public name, read from its module (imported on first use)."""
    if name in _PUBLIC_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; its public names are {__all__}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)

