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
from accounting.ledger.verification.rows import (
    StoredAdminToken,
    StoredCommit,
    StoredEntry,
    StoredReservation,
    StoredTenant,
)

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


_ADMIN_TOKEN_ACTIONS = ("register_admin_token", "adopt_admin_tokens")


class TenantReplay:
    """Every tenant and its token's key id and digest, and every admin token, as the history replays them.

    A tenant's token is the one its last `create_tenant`, `rotate_token` or
    `revoke_token` entry names (a revoked tenant has none). An admin token
    is one a `register_admin_token` (a server started with it), an admin
    `rotate_token` or an `adopt_admin_tokens` (the tokens a ledger kept
    before schema version 12) entry names, live until an entry revokes it.
    """

    def __init__(self) -> None:
        self.created: dict[str, dict] = {}
        # By key id: the admin token's digest (None where an entry before schema version 12 did not record it)
        # and whether it was revoked.
        self.admins: dict[str, dict] = {}

    def apply(self, entry: StoredEntry) -> None:
        """Extend the replay by one history entry."""
        if entry.action not in ("create_tenant", "rotate_token", "revoke_token", *_ADMIN_TOKEN_ACTIONS):
            return
        details = json.loads(entry.details_json)
        if entry.action in _ADMIN_TOKEN_ACTIONS or details.get("admin"):
            self._apply_admin(entry.action, details)
            return
        if details.get("tenant") is None:
            return
        if entry.action == "revoke_token":
            details = {**details, "key_id": None, "token_digest": None}
        self.created[details["tenant"]] = details if entry.action == "create_tenant" else {
            **self.created.get(details["tenant"], {}), **details}

    def _apply_admin(self, action: str, details: dict) -> None:
        if action == "adopt_admin_tokens":
            for token in details["admin_tokens"]:
                self.admins[token["key_id"]] = {"token_digest": token["token_digest"], "revoked": token["revoked"]}
        elif action == "revoke_token":
            self.admins.setdefault(details["key_id"], {"token_digest": None})["revoked"] = True
        else:  # a registration, or a rotation: the new token, and the one it replaced revoked
            self.admins[details["key_id"]] = {"token_digest": details.get("token_digest"), "revoked": False}
            for key_id in details.get("revoked_key_ids") or ():
                self.admins.setdefault(key_id, {"token_digest": None})["revoked"] = True

    def findings(self, tenants: list[StoredTenant], admin_tokens: list[StoredAdminToken]) -> list[Finding]:
        """Where the tenants and admin_tokens tables differ from the replay: every tenant, its token's key id and
        digest, and every admin token, its digest and whether it is revoked."""
        findings = self._admin_findings(admin_tokens)
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

    def _admin_findings(self, admin_tokens: list[StoredAdminToken]) -> list[Finding]:
        findings = []
        stored = {token.key_id: token for token in admin_tokens}
        for key_id in sorted(set(stored) | set(self.admins)):
            row, replayed = stored.get(key_id), self.admins.get(key_id)
            if row is None or replayed is None:
                findings.append(_unpaired(key_id, replayed is None, "admin token"))
            elif row.revoked != replayed["revoked"]:
                findings.append(Finding(None, None, f"{key_id}: its history revoked it, but its row is live (its "
                                                    "revocation was cleared)" if replayed["revoked"] else
                                                    f"{key_id}: its row is revoked, but its history never revoked it",
                                        row="admin token"))
            elif replayed["token_digest"] is not None and row.token_digest != replayed["token_digest"]:
                findings.append(Finding(None, None, f"{key_id}: its token is not the one its history records (a "
                                                    "token was swapped in the table)", row="admin token"))
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
