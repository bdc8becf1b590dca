"""The ledger's times: UTC ISO 8601 text to the millisecond, which compares in time order as text."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone


def now() -> str:
    """Now, as every row and history entry of the ledger writes a time."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def expiry(lease_seconds: float | None) -> str | None:
    """When a lease of `lease_seconds` taken now ends (None without a lease); compares as text with `now()`."""
    if lease_seconds is None:
        return None
    return (datetime.now(timezone.utc) + timedelta(seconds=lease_seconds)).isoformat(timespec="milliseconds")
