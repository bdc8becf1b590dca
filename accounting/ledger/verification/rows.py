"""The store's rows as `verify` reads them, to compare with what the history replays to."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

from accounting.events import Composition
from accounting.ledger.admission import AdmissionRule, RdpTally


class StoredEntry(NamedTuple):
    """A history entry as the store holds it, with `details_json` the stored text, for `verify`.

    A tuple in the order of the history's columns, so a stored row is one as it is.
    """

    entry_id: int
    at: str
    actor: str
    action: str
    tenant: str | None
    dataset_id: int | None
    details_json: str
    previous_hash: str
    entry_hash: str


@dataclass(frozen=True)
class StoredDataset:
    """What a dataset's row holds now, for `verify` to compare with the replay of its history."""

    dataset_id: int
    name: str
    budget_epsilon: float
    delta: float
    admission: AdmissionRule
    held: RdpTally
    committed_events: Composition
    block_of: int | None = None
    block: str | None = None
    data: dict | None = None


@dataclass(frozen=True)
class StoredTenantUse:
    """A tenant's tally on one budget (a dataset or a block) and its quota there, if any, for `verify`."""

    budget_id: int
    tenant: str
    quota_epsilon: float | None
    quota_rule: AdmissionRule | None
    held: RdpTally
    committed_events: Composition


@dataclass(frozen=True)
class StoredReservation:
    """A row of the reservations table, for `verify` to compare with the replay of its history.

    Its planned events and blocks are the stored JSON text (Composition.to_json, a JSON list): compared as text,
    so that `verify` parses no row of a table that grows with every job.
    """

    reservation_id: str
    dataset_id: int
    tenant: str
    job_id: str
    planned_json: str
    committed_steps: int
    state: str
    lease_seconds: float | None
    lease_expired: bool
    blocks_json: str


class StoredCommit(NamedTuple):
    """A row of the commits table: a reservation's commit of `steps` under `sequence`, reaching `committed_steps`."""

    reservation_id: str
    sequence: int
    steps: int
    committed_steps: int


class StoredPlan(NamedTuple):
    """A row of the plans table: a plan's jobs as the stored JSON text, the (epsilon, delta) charged, the jobs
    started; compared with the replay of its history."""

    dataset_id: int
    name: str
    tenant: str
    jobs_json: str
    epsilon: float
    delta: float
    started_jobs: int


class StoredPlanJob(NamedTuple):
    """A row of the plan_jobs table: the reservation of one started job of a plan, and its place in the plan."""

    reservation_id: str
    dataset_id: int
    plan: str
    job_index: int


@dataclass(frozen=True)
class StoredTenant:
    """A row of the tenants table: its token's key id and a digest of its salt and token hash (None: no token)."""

    name: str
    key_id: str | None
    token_digest: str | None


@dataclass(frozen=True)
class StoredAdminToken:
    """A row of the admin_tokens table: its key id, a digest of its token hash (stored_token_digest), and whether
    it was revoked."""

    key_id: str
    token_digest: str
    revoked: bool


def stored_token_digest(salt: bytes | None, token_hash: bytes | None) -> str | None:
    """What a tenant's token entries record of its stored salt and hash, so `verify` sees them swapped.

    None for a tenant without a token (revoked); the salt is None for a token stored by its digest.
    """
    if token_hash is None:
        return None
    return hashlib.sha256(bytes(salt or b"") + bytes(token_hash)).hexdigest()
