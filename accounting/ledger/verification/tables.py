"""The jobs, commits, tenants and queues tables compared with what the history replays them to.

Each replay is state extended entry by entry (`apply`) and compared with the
tables at the end (`findings`), so `verify` can keep it at its last verified
entry and extend it by the entries after.
"""

from __future__ import annotations

import json

from accounting.events import Composition, EventError
from accounting.ledger.validation import ACTIVE, RELEASED
from accounting.ledger.verification.findings import Finding
from accounting.ledger.verification.replay import JOB_ACTIONS
from accounting.ledger.verification.rows import StoredCommit, StoredEntry, StoredReservation, StoredTenant

_QUEUE_ACTIONS = ("enqueue", "reserve", "cancel_queued", "queue_timeout")


class JobReplay:
    """Every reservation and commit as the history replays them, to compare with the tables' rows."""

    def __init__(self) -> None:
        self.replayed: dict[str, dict] = {}
        self.replayed_commits: set[tuple[str, int, int, int]] = set()
        # The first entry that could not be replayed: the jobs are compared no further.
        self.failure: Finding | None = None

    def apply(self, entry: StoredEntry) -> None:
        """Extend the replay by one history entry."""
        if entry.action not in JOB_ACTIONS or self.failure is not None:
            return
        try:
            self._apply(entry, json.loads(entry.details_json))
        except (KeyError, TypeError, ValueError, EventError) as error:
            self.failure = Finding(None, None, f"the history's jobs cannot be replayed ({type(error).__name__}: "
                                               f"{error})", row="reservations")

    def _apply(self, entry: StoredEntry, details: dict) -> None:
        if entry.action == "reserve":
            # Planned events and blocks as the reservations table writes them (see StoredReservation).
            self.replayed[details["reservation_id"]] = {
                "dataset_id": entry.dataset_id, "tenant": entry.tenant, "job_id": details["job_id"],
                "planned_json": Composition.from_dict(details["planned_events"]).to_json(), "committed_steps": 0,
                "state": ACTIVE, "lease_seconds": details.get("lease_seconds"), "lease_expired": False,
                "blocks_json": json.dumps(list(details.get("blocks") or ())),
            }
        elif details["reservation_id"] in self.replayed:
            job = self.replayed[details["reservation_id"]]
            if entry.action == "commit":
                steps = Composition.from_dict(details["events"]).steps
                job["committed_steps"] += steps
                # A plain tuple, equal to its StoredCommit row: the kept state pickles it cheaply.
                self.replayed_commits.add((details["reservation_id"], details["sequence"], steps, job["committed_steps"]))
            else:
                job["state"], job["lease_expired"] = RELEASED, entry.action == "expire"

    def findings(self, reservations: list[StoredReservation], commits: list[StoredCommit]) -> list[Finding]:
        """Where the reservations' and commits' rows differ from the replay."""
        if self.failure is not None:
            return [self.failure]
        findings = []
        stored = {reservation.reservation_id: reservation for reservation in reservations}
        for reservation_id in sorted(set(stored) | set(self.replayed)):
            row, job = stored.get(reservation_id), self.replayed.get(reservation_id)
            if row is None or job is None:
                findings.append(_unpaired(reservation_id, job is None, "reservation"))
                continue
            differing = [name.removesuffix("_json") for name, value in job.items() if getattr(row, name) != value]
            if differing:
                findings.append(Finding(None, None, f"{reservation_id}: its row differs from what its history replays "
                                                    f"to in {', '.join(differing)}", row="reservation"))
        stored_commits = set(commits)
        for commit in map(StoredCommit._make, sorted(stored_commits ^ self.replayed_commits, key=lambda c: c[:3])):
            where = "has a row but no history entry" if commit in stored_commits else "is in the history but has no row"
            findings.append(Finding(None, None, f"sequence {commit.sequence} of {commit.reservation_id} "
                                                f"({commit.steps} steps) {where}", row="commit"))
        return findings


def _unpaired(name: str, row_only: bool, kind: str) -> Finding:
    """The finding for a `kind` row that its history does not replay to (`row_only`), or history without its row."""
    where = "has a row but no history" if row_only else "is in the history but has no row"
    return Finding(None, None, f"{name} {where}", row=kind)


class TenantReplay:
    """Every tenant and its token's key id and digest as the history replays them.

    A tenant's token is the one its last `create_tenant`, `rotate_token` or
    `revoke_token` entry names (a revoked tenant has none).
    """

    def __init__(self) -> None:
        self.created: dict[str, dict] = {}

    def apply(self, entry: StoredEntry) -> None:
        """Extend the replay by one history entry."""
        if entry.action not in ("create_tenant", "rotate_token", "revoke_token"):
            return
        details = json.loads(entry.details_json)
        if details.get("tenant") is None:  # an admin token's rotation or revocation
            return
        if entry.action == "revoke_token":
            details = {**details, "key_id": None, "token_digest": None}
        self.created[details["tenant"]] = details if entry.action == "create_tenant" else {
            **self.created.get(details["tenant"], {}), **details}

    def findings(self, tenants: list[StoredTenant]) -> list[Finding]:
        """Where the tenants table differs from the replay: every tenant, its token's key id and digest."""
        findings = []
        stored = {tenant.name: tenant for tenant in tenants}
        for name in sorted(set(stored) | set(self.created)):
            row, details = stored.get(name), self.created.get(name)
            if row is None or details is None:
                findings.append(_unpaired(name, details is None, "tenant"))
            elif row.key_id != details.get("key_id") or (
                "token_digest" in details and row.token_digest != details["token_digest"]
            ):
                findings.append(Finding(None, None, f"{name}: its token is not the one its history records (a token "
                                                    "was swapped in the table)", row="tenant"))
        return findings


class QueueReplay:
    """The queues replayed: a job leaves one (admitted by a `reserve` with its `queue_id`, cancelled or timed
    out) only while it waits there, and is admitted with the plan and blocks it queued with."""

    def __init__(self) -> None:
        self.waiting: dict[tuple[int | None, str], dict] = {}
        self.findings: list[Finding] = []

    def apply(self, entry: StoredEntry, dataset_names: dict[int, str]) -> None:
        """Extend the replay by one history entry, noting a departure from the queue's rules."""
        details = json.loads(entry.details_json) if entry.action in _QUEUE_ACTIONS else {}
        if entry.action == "enqueue":
            self.waiting[(entry.dataset_id, details["queue_id"])] = details
        elif "queue_id" in details:
            queued = self.waiting.pop((entry.dataset_id, details["queue_id"]), None)
            where = dataset_names.get(entry.dataset_id, str(entry.dataset_id))
            if queued is None:
                self.findings.append(Finding(entry.entry_id, where, f"takes queued job {details['queue_id']} out of "
                                                                    "the queue, where the replay does not have it"))
            elif entry.action == "reserve" and (
                (queued["planned_events"], queued.get("blocks") or []) !=
                (details["planned_events"], details.get("blocks") or [])
            ):
                self.findings.append(Finding(entry.entry_id, where, f"admits queued job {details['queue_id']} with "
                                                                    "a plan or blocks other than it queued with"))
