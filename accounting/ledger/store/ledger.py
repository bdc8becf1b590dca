"""`Ledger`, the embedded ledger and what a server serves: the store's tables composed with the pure core.

Each public method validates its arguments (core), opens one transaction
(`transactions`) and composes the repositories (one per table) with the
rules of the package: authorisation, admission, the queue, leases, status and
verification. Each change appends an entry to the keyed history (`history`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from accounting.events import Composition, EventsLike
from accounting.ledger.admission import (
    AdmissionRule,
    FitReport,
    RdpTally,
    charged_plan,
    check_block_data,
    check_dataset_content,
    check_new_budget,
    check_plan,
    check_plan_delta,
    check_plan_share,
    check_pool_admits,
    fits_budget,
    plan_epsilon,
    plan_jobs_json,
    refuse_without_pool,
    rule_with_pool,
    split_budget,
    uncached_mechanisms,
)
from accounting.ledger.callers import ADMIN, LOCAL_TENANT, Caller, resolve_dataset
from accounting.ledger.databases import Connection, open_database
from accounting.ledger.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    LedgerUnavailable,
    NotFound,
    PermissionDenied,
)
from accounting.ledger.limits import COMPOSED_STEPS_PER_UNIT, TokenBuckets
from accounting.ledger.records import (
    CommitResult,
    DatasetStatus,
    HistoryEntry,
    JobCharge,
    PlanStatus,
    QueuedJob,
    Reservation,
    TenantCreated,
)
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.store import admission, queueing
from accounting.ledger.store.admission import JobRequest
from accounting.ledger.store.authorisation import (
    Authenticator,
    acting_caller,
    job_tenant,
    require_admin,
    visible_dataset,
    visible_queued_job,
    visible_reservation,
)
from accounting.ledger.store.clock import now
from accounting.ledger.store.composed import BackgroundComposition
from accounting.ledger.store.history import HistoryChain, by_key
from accounting.ledger.store.leases import expire_leases
from accounting.ledger.store.local import (
    HistoryKeySource,
    default_history_key_path,
    default_ledger_path,
    load_history_key,
    local_user,
)
from accounting.ledger.store.schema import create_or_check_schema
from accounting.ledger.store.status import StatusRows, budget_ids, dataset_status, read_status
from accounting.ledger.store.tables import Tables
from accounting.ledger.store.transactions import Transactions, curves_outside_lock
from accounting.ledger.store.uses import Quota
from accounting.ledger.store.verification import keep_verified_state, read_stored, verify_stored
from accounting.ledger.tokens import admin_key_id, new_token, token_digest
from accounting.ledger.validation import (
    ACTIVE,
    ADMITTED,
    CANCELLED,
    EXAMPLE,
    QUEUED,
    check_block_names,
    check_budget_epsilon,
    check_delta,
    check_history_limit,
    check_lease_seconds,
    check_max_wait_seconds,
    MAX_PLAN_JOBS,
    check_name,
    check_priority,
    check_privacy_unit,
    check_queue_state,
    check_rows_per_person,
    check_scheduling,
    check_sequence,
    check_state,
    check_steps,
)
from accounting.ledger.verification import SignedHead, Verification, job_charges, sign_head, stored_token_digest


class Ledger:
    """The privacy ledger on an SQLite file or a PostgreSQL database: the embedded ledger, and what a server serves.

    `path` is the SQLite file, or a postgresql:// URL; `scheduling` the
    policy of queued jobs for datasets created without one (fcfs by
    default); `history_key_file` the history key, a file's path or a
    HistoryKeySource (`load_history_key`; default
    `default_history_key_path()`). Every method takes
    the `caller` it acts for; it defaults to the caller the ledger was
    opened with (the local admin for `open_embedded_ledger`). Safe to share
    between threads; several processes (servers) may open the same file or
    database.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        caller: Caller | None = None,
        scheduling: SchedulingPolicy | None = None,
        history_key_file: str | os.PathLike | HistoryKeySource | None = None,
    ) -> None:
        history_key = load_history_key(history_key_file)
        self._database = open_database(path)
        self._history = HistoryChain(
            history_key, history_key_file or default_history_key_path(), self._database.location
        )
        self._default_scheduling = scheduling or SchedulingPolicy()
        self.path = Path(path) if self._database.is_file else str(path)
        self._default_caller = caller
        self._transactions = Transactions(self._database)
        self._tables = Tables.of(self._database, self._history)
        self._composition = BackgroundComposition(self._compose_committed)
        self._authenticator = Authenticator(self._transactions, self._tables.tenants)
        # Set by a server: the buckets of tenants' costly requests (see `_charge_curves`); None charges nothing.
        self.curve_limits: TokenBuckets | None = None
        try:
            create_or_check_schema(self._transactions, self._database, self._history, self._default_caller)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the store; a read in progress finishes first on its own connection, which closes after it.

        A background composition under way finishes first, and the composed
        states not yet kept are written, so that a restart extends them.
        """
        self._composition.close()
        with contextlib.suppress(LedgerUnavailable, FailedPrecondition):
            self._keep_composed(self._tables.composed.due(every=0.0))
        self._transactions.close()

    def _caller(self, caller: Caller | None) -> Caller:
        return acting_caller(caller, self._default_caller)

    def _status(self, caller: Caller, rows: StatusRows, pld_may_be_pending: bool = False) -> DatasetStatus:
        """A dataset's status from its rows, each budget's PLD extended from its composed state; the states
        due to be kept are written (see store.composed)."""
        status = dataset_status(caller, rows, pld_may_be_pending, self._tables.composed.lineage)
        # A cache of a report: a database that does not answer now fails the next change, not this status.
        with contextlib.suppress(LedgerUnavailable):
            self._keep_composed(self._tables.composed.due(budget_ids(rows)))
        return status

    def _keep_composed(self, due: list) -> None:
        """Write the composed states `due` (ComposedDistributions.due) in one change."""
        if due:
            with self._transactions.change() as connection:
                for budget_id, state in due:
                    self._tables.composed.keep(connection, budget_id, state)

    def _compose_committed(self, dataset_ids: set[int]) -> None:
        """What a status of each of the datasets does (each budget's PLD extended by the steps committed since,
        the states due kept), for the background composition after commits (store.composed)."""
        with self._transactions.read() as connection:
            all_rows = [
                read_status(self._tables, connection, ADMIN, self._tables.datasets.by_id(connection, dataset_id))
                for dataset_id in sorted(dataset_ids)
            ]
        for rows in all_rows:
            self._status(ADMIN, rows)

    def _ensure_tokenless_tenant(self, tenant: str, caller: Caller) -> None:
        with self._transactions.change() as connection:
            if self._tables.tenants.insert_tokenless(connection, tenant):
                self._history.record(
                    connection, caller, "create_tenant", tenant, None,
                    by_key(caller, {"tenant": tenant, "token": False}),
                )

    # ------------------------------------------------------------ identity

    def verified_caller(self, token: str) -> Caller | None:
        """The caller of a live token stored by digest, or None (then `authenticate` checks a token still stored
        by scrypt, or refuses it).

        No read of the database: the live tokens are kept in memory and read
        again, at most every TOKEN_RECHECK_SECONDS, when a creation, rotation or
        revocation on this server or another of the database changed them.
        """
        return self._authenticator.verified_caller(token)

    def knows_key_id(self, token: str) -> bool:
        """Whether the key id `token` names is a live token's (no read: see `verified_caller`); only then can a
        token of that key id be right."""
        return self._authenticator.knows_key_id(token)

    def authenticate(self, token: str) -> Caller:
        """The admin or tenant a token belongs to; raises Unauthenticated for an unknown or revoked token.

        A token costs one fast hash and lookups in memory (`verified_caller`).
        A tenant token still stored by scrypt (schema version 6 and before) is
        checked with scrypt once and then stored by digest.
        """
        return self._authenticator.authenticate(token)

    def register_admin_token(self, token: str) -> None:
        """Keep the admin token a server was started with (once), recorded in a `register_admin_token` entry by its
        key id and a digest of its digest (never the token); a revoked one stays revoked."""
        key_id, digest = admin_key_id(token), token_digest(token)
        with self._transactions.change() as connection:
            if not self._tables.tenants.add_admin_token(connection, key_id, digest, unless_known=True):
                return
            starter = Caller(actor="ledger server (its start-up admin token)", tenant=None, admin=True, key_id=key_id)
            self._history.record(connection, starter, "register_admin_token", None, None, by_key(starter, {
                "key_id": key_id, "token_digest": stored_token_digest(None, digest)}))
            self._authenticator.tokens_changed(connection)

    def rotate_token(self, tenant: str | None = None, *, caller: Caller | None = None) -> TenantCreated:
        """Replace a token with a new one, shown this once; the old one stops working on every server within
        a second (TOKEN_RECHECK_SECONDS plus a read).

        `tenant` names a tenant's token (the admin's to rotate, or the
        tenant's own); None the admin token the caller authenticated with
        (admin only). The reply's `tenant` is None for an admin token.
        """
        caller = self._caller(caller)
        if tenant is None:
            require_admin(caller, "rotating the admin token needs the admin token; a tenant rotates its own")
            key_id, token = new_token()
            with self._transactions.change() as connection:
                self._tables.tenants.add_admin_token(connection, key_id, token_digest(token))
                revoked = []
                if caller.key_id is not None:
                    revoked = [caller.key_id]
                    self._tables.tenants.revoke_admin_token(connection, caller.key_id)
                self._authenticator.tokens_changed(connection)
                self._history.record(connection, caller, "rotate_token", None, None, by_key(caller, {
                    "admin": True, "key_id": key_id, "revoked_key_ids": revoked,
                    "token_digest": stored_token_digest(None, token_digest(token))}))
            return TenantCreated(None, token)
        check_name("tenant name", tenant)
        if not (caller.admin or caller.tenant == tenant):
            raise PermissionDenied(f"a tenant rotates only its own token; rotating {tenant!r}'s needs the admin token")
        key_id, token = new_token()
        with self._transactions.change() as connection:
            row = self._tables.tenants.named(connection, tenant)
            if row is None:
                raise NotFound(f"tenant {tenant!r} does not exist; create it with dpfleet ledger tenant create")
            self._tables.tenants.set_token(connection, tenant, key_id, token_digest(token))
            self._authenticator.tokens_changed(connection)
            self._history.record(
                connection, caller, "rotate_token", tenant, None,
                by_key(caller, {"tenant": tenant, "key_id": key_id,
                                "revoked_key_ids": [row.key_id] if row.key_id else [],
                                "token_digest": stored_token_digest(None, token_digest(token))}),
            )
        return TenantCreated(tenant, token)

    def revoke_token(
        self, tenant: str | None = None, key_id: str | None = None, *, caller: Caller | None = None
    ) -> str:
        """Revoke a tenant's token, or the admin token of `key_id` (admin only); the revoked key id.

        It stops working on every server within a second. A tenant without a
        token can do nothing until an admin rotates one in for it; the last
        admin token is not revoked (rotate it instead).
        """
        caller = self._caller(caller)
        require_admin(caller, "revoking a token needs the admin token (a tenant can rotate its own)")
        if (tenant is None) == (key_id is None):
            raise InvalidArgument("name either a tenant, or the key id of an admin token (got both or neither)")
        with self._transactions.change() as connection:
            if tenant is not None:
                check_name("tenant name", tenant)
                row = self._tables.tenants.named(connection, tenant)
                if row is None:
                    raise NotFound(f"tenant {tenant!r} does not exist (dpfleet ledger status lists what you see)")
                if row.key_id is None:
                    raise FailedPrecondition(f"tenant {tenant!r} has no token to revoke")
                self._tables.tenants.set_token(connection, tenant, None, None)
                revoked = row.key_id
            else:
                check_name("admin key id", key_id)
                live = self._tables.tenants.live_admin_key_ids(connection)
                if key_id not in live:
                    raise NotFound(
                        f"no admin token with key id {key_id!r} is in use; those in use are {', '.join(live)}"
                    )
                if live == [key_id]:
                    raise FailedPrecondition(
                        f"admin token {key_id} is the last one; rotate it (dpfleet ledger token rotate --admin) instead"
                    )
                self._tables.tenants.revoke_admin_token(connection, key_id)
                revoked = key_id
            self._authenticator.tokens_changed(connection)
            self._history.record(connection, caller, "revoke_token", tenant, None,
                                 by_key(caller, {"tenant": tenant, "admin": tenant is None, "key_id": revoked}))
        return revoked

    def create_tenant(self, tenant: str, *, caller: Caller | None = None) -> TenantCreated:
        """Create a tenant and return its token, shown this once (admin only)."""
        caller = self._caller(caller)
        require_admin(
            caller, "creating a tenant needs the admin token (the server's --admin-token-file or DPFLEET_ADMIN_TOKEN)"
        )
        check_name("tenant name", tenant)
        key_id, token = new_token()
        with self._transactions.change() as connection:
            if not self._tables.tenants.insert(connection, tenant, key_id, token_digest(token)):
                raise AlreadyExists(f"tenant {tenant!r} already exists; choose another name")
            self._authenticator.tokens_changed(connection)
            self._history.record(
                connection, caller, "create_tenant", tenant, None,
                by_key(caller, {"tenant": tenant, "key_id": key_id,
                                "token_digest": stored_token_digest(None, token_digest(token))}),
            )
        return TenantCreated(tenant, token)

    # ------------------------------------------------------------ datasets

    def create_dataset(
        self,
        dataset: str,
        epsilon: float,
        delta: float,
        privacy_unit: str = EXAMPLE,
        scheduling: SchedulingPolicy | dict | None = None,
        plan_share: float = 0.0,
        *,
        caller: Caller | None = None,
    ) -> DatasetStatus:
        """Create a dataset with a budget of `epsilon` at `delta` for the whole life of the data.

        The budget is per `privacy_unit`: one row ('example') or one person
        with all its rows ('user'); see `charged_plan` for jobs of the other unit.
        `scheduling` is how its queue of waiting jobs is served (default: the ledger's).
        `plan_share` of the budget (epsilon and delta alike) is set aside, for
        good, as the pool pre-registered plans are charged from
        (`register_plan`); the filter admits jobs within the rest.
        """
        return self.register_dataset(dataset, epsilon, delta, privacy_unit, scheduling, None, plan_share,
                                     caller=caller)

    def register_dataset(
        self,
        dataset: str,
        epsilon: float,
        delta: float,
        privacy_unit: str = EXAMPLE,
        scheduling: SchedulingPolicy | dict | None = None,
        content: list[str] | None = None,
        plan_share: float = 0.0,
        *,
        caller: Caller | None = None,
    ) -> DatasetStatus:
        """`create_dataset`, recording `content`: a first-use registration's training files' SHA-256s
        (`check_dataset_content`), refused when a dataset already registered a file of it, so rows get one budget
        whatever the dataset is called and wherever its files are (the embedded ledger's first use only).
        """
        caller = self._caller(caller)
        epsilon = check_budget_epsilon(epsilon)
        delta = check_delta(delta)
        privacy_unit = check_privacy_unit(privacy_unit)
        scheduling = check_scheduling(scheduling) if scheduling is not None else self._default_scheduling
        content = check_dataset_content(content) if content is not None else None
        plan_share = check_plan_share(plan_share)
        reference = resolve_dataset(caller, dataset)
        rule = rule_with_pool(epsilon, delta, plan_share)
        # The row's and the entry's budget are the filter's part; the pool is recorded with the rule.
        (epsilon, delta), _ = split_budget(epsilon, delta, plan_share)
        with self._transactions.change() as connection:
            if not self._tables.tenants.exists(connection, reference.tenant):
                raise NotFound(
                    f"tenant {reference.tenant!r} does not exist; create it with dpfleet ledger tenant create"
                )
            self._refuse_content_held_elsewhere(connection, reference, dataset, content)
            dataset_id = self._tables.datasets.insert_dataset(
                connection, reference.tenant, reference.name, epsilon, delta, rule, privacy_unit, scheduling
            )
            if dataset_id is None:
                raise AlreadyExists(
                    f"dataset {dataset!r} already exists; an admin can raise its budget (dpfleet ledger dataset raise)"
                )
            self._history.record(
                connection, caller, "create_dataset", reference.tenant, dataset_id, by_key(
                    caller,
                    {"epsilon": epsilon, "delta": delta, "admission": rule.to_dict(), "privacy_unit": privacy_unit,
                     "scheduling": scheduling.to_dict(), **({"content": content} if content is not None else {})},
                ),
            )
            rows = read_status(
                self._tables, connection, caller, visible_dataset(self._tables, connection, caller, dataset)
            )
        return self._status(caller, rows)

    def check_registrable(self, dataset: str, content: list[str], *, caller: Caller | None = None) -> None:
        """Refuse (FailedPrecondition), as `register_dataset` would, `content` (training files' SHA-256s) of which
        another dataset already registered a file; reads only (`dpfleet ledger fits` before a first use)."""
        caller = self._caller(caller)
        content = check_dataset_content(content)
        reference = resolve_dataset(caller, dataset)
        with self._transactions.read() as connection:
            self._refuse_content_held_elsewhere(connection, reference, dataset, content)

    def _refuse_content_held_elsewhere(self, connection, reference, dataset: str, content: list[str] | None) -> None:
        """FailedPrecondition when a dataset other than `reference` registered a file of `content`, naming it."""
        holder = self._tables.datasets.holding_content(connection, content) if content is not None else None
        registered = None if holder is None else self._tables.datasets.by_id(connection, holder[0])
        if registered is None or (registered.tenant, registered.name) == (reference.tenant, reference.name):
            return  # nothing held, or by the dataset itself (registering it again says it exists)
        raise FailedPrecondition(
            f"the data of dataset {dataset!r} is already registered as dataset "
            f"{registered.tenant}/{registered.name} (a file of SHA-256 {holder[1][:16]}… is in both): rows "
            f"get one budget, whatever their dataset is called and wherever their files are; train under "
            f"that name (--dataset-name {registered.name})"
        )

    def raise_budget(self, dataset: str, epsilon: float, *, caller: Caller | None = None) -> DatasetStatus:
        """Set a dataset's budget epsilon (admin only); refused below what is committed and reserved."""
        caller = self._caller(caller)
        require_admin(
            caller, "changing a budget needs the admin token (the server's --admin-token-file or DPFLEET_ADMIN_TOKEN)"
        )
        epsilon = check_budget_epsilon(epsilon)
        with self._transactions.change() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset)
            check_new_budget(dataset, row.rule(), epsilon, RdpTally.from_json(row.held_rdp))
            largest_block = self._tables.datasets.largest_block_epsilon(connection, row.dataset_id)
            if largest_block is not None and epsilon < largest_block:
                raise FailedPrecondition(
                    f"dataset {dataset!r} has a block of ε {largest_block:g}; its budget, the most any row or person "
                    f"of it may spend, cannot be below that (got ε {epsilon:g}). Choose at least ε {largest_block:g}"
                )
            self._tables.datasets.set_budget(connection, row.dataset_id, epsilon)
            self._history.record(
                connection, caller, "raise_budget", row.tenant, row.dataset_id,
                by_key(caller, {"from": row.budget_epsilon, "to": epsilon}),
            )
            rows = read_status(
                self._tables, connection, caller, visible_dataset(self._tables, connection, caller, dataset)
            )
        return self._status(caller, rows)

    def bind_content(self, dataset: str, content: list[str], *, caller: Caller | None = None) -> DatasetStatus:
        """Before a job trains on `dataset`, bind `content` (the SHA-256s of the files it reads,
        workers.fingerprints.file_digests) to it on its first use, or check that they are among the files bound
        before; FailedPrecondition for files another dataset holds, or files not the dataset's
        (`admission.bind_content`). Its owner, an admin, or a tenant with a quota on it.

        Files bound already, as every job after a dataset's first finds
        them, are checked on a snapshot, beside the writes: only a first
        binding takes the write lock.
        """
        caller = self._caller(caller)
        content = check_dataset_content(content)
        with self._transactions.read() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset, shared=True)
            if admission.content_is_bound(self._tables, connection, dataset, row, content):
                return self._status(caller, read_status(self._tables, connection, caller, row))
        with self._transactions.change() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset, shared=True)
            admission.bind_content(self._tables, connection, caller, dataset, row, content)
            rows = read_status(self._tables, connection, caller, row)
        return self._status(caller, rows)

    def add_block(
        self, dataset: str, block: str, epsilon: float, delta: float | None = None, data: dict | str | None = None,
        *, caller: Caller | None = None,
    ) -> DatasetStatus:
        """Add a block (a part of the dataset's data, e.g. one day's) with its own budget of `epsilon` at `delta`.

        `data` declares where the block's rows are (`check_block_data`); a
        declaration that may share a row (or, on a per-person dataset, a
        person) with another block's is refused, so each unit is in one
        block at most and its guarantee is that block's budget. The block's
        (epsilon, delta) is at most the dataset's, and a dataset whose own
        budget was charged (its jobs read every row), or that has a plan
        pool, takes no block.
        `delta` defaults to the dataset's; the block protects the dataset's
        privacy unit. The dataset's owner or an admin may add one. Jobs on
        the dataset then name the blocks they train on, and each is charged
        in full to every block it names.
        """
        caller = self._caller(caller)
        check_name("block name", block)
        epsilon = check_budget_epsilon(epsilon, "block epsilon")
        with self._transactions.change() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset)
            delta = row.delta if delta is None else check_delta(delta)
            data = check_block_data(data, row.privacy_unit)
            if row.rule().has_plan_pool:
                raise FailedPrecondition(
                    f"dataset {dataset!r} set a plan pool aside, whose plans' jobs read every row; it takes no "
                    "block. Create a dataset of blocks without a plan share"
                )
            admission.check_new_block(self._tables, connection, dataset, row, block, epsilon, delta, data)
            rule = AdmissionRule.for_budget(epsilon, delta)
            block_id = self._tables.datasets.insert_block(connection, row, block, epsilon, delta, rule, data)
            if block_id is None:
                raise AlreadyExists(f"dataset {dataset!r} already has a block {block!r}; choose another name")
            self._history.record(
                connection, caller, "add_block", row.tenant, block_id, by_key(
                    caller,
                    {"dataset": row.name, "block": block, "epsilon": epsilon, "delta": delta,
                     "admission": rule.to_dict(), "data": data},
                ),
            )
            rows = read_status(self._tables, connection, caller, row)
        return self._status(caller, rows)

    def set_quota(
        self, dataset: str, tenant: str, epsilon: float, block: str | None = None, *, caller: Caller | None = None
    ) -> DatasetStatus:
        """Give `tenant` a quota of `epsilon` on a dataset, or on one of its blocks (admin only).

        The quota is an extra RDP filter, at orders of its own taken from
        (epsilon, the budget's delta), on the tenant's own tally: a job of
        the tenant needs both the budget's filter and this one. A quota set
        on a dataset applies to each of its blocks that has none of its own.
        It lets a tenant other than the owner use the dataset. Setting it
        again replaces it; a quota below what the tenant holds admits no new
        job until enough is released.
        """
        caller = self._caller(caller)
        require_admin(
            caller, "setting a quota needs the admin token (the server's --admin-token-file or DPFLEET_ADMIN_TOKEN)"
        )
        check_name("tenant name", tenant)
        epsilon = check_budget_epsilon(epsilon, "quota epsilon")
        blocks = () if block is None else check_block_names([block])
        with self._transactions.change() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset)
            if not self._tables.tenants.exists(connection, tenant):
                raise NotFound(f"tenant {tenant!r} does not exist; create it with dpfleet ledger tenant create")
            (budget,) = admission.budget_rows(self._tables, connection, row, blocks, dataset) if blocks else (row,)
            rule = AdmissionRule.for_budget(epsilon, budget.delta)
            use = self._tables.uses.use(connection, budget.dataset_id, tenant)
            self._tables.uses.set_use(connection, budget.dataset_id, tenant, use.held, use.committed)
            self._tables.uses.set_quota(connection, budget.dataset_id, tenant, Quota(epsilon, rule))
            held_epsilon = rule.epsilon(use.held)
            self._history.record(
                connection, caller, "set_quota", tenant, budget.dataset_id, by_key(
                    caller,
                    {"tenant": tenant, "block": block, "epsilon": epsilon, "admission": rule.to_dict(),
                     "held_epsilon_filter": held_epsilon, "held_fits_quota": fits_budget(held_epsilon, epsilon)},
                ),
            )
            rows = read_status(self._tables, connection, caller, row)
        return self._status(caller, rows)

    def fits(
        self, dataset: str, planned: EventsLike, blocks: tuple[str, ...] | list[str] = (),
        privacy_unit: str = EXAMPLE, rows_per_person: int | None = None, *, caller: Caller | None = None,
    ) -> FitReport:
        """Whether a job would be admitted now, what it would cost and what would remain; reserves nothing.

        The same conversion (`charged_plan`) and checks as `reserve`, on one
        snapshot of the budgets; a reservation made later meets the budgets
        as they are then.
        """
        caller = self._caller(caller)
        self._charge_curves(caller, 1)
        blocks = check_block_names(blocks)
        _, charged, _ = self._charged(caller, dataset, planned, privacy_unit, rows_per_person)
        self._charge_curves(caller, uncached_mechanisms(charged))
        planned_tally = RdpTally.of(charged)
        with self._transactions.read() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset, shared=True)
            budgets = admission.budget_rows(self._tables, connection, row, blocks, dataset, new_job=True)
            checks, quota_checks = admission.admission_checks(
                self._tables, connection, job_tenant(caller, row), row, budgets, planned_tally, dataset
            )
        return FitReport(dataset, blocks, (*checks, *quota_checks))

    def get_budget(
        self, dataset: str, pld_may_be_pending: bool = False, *, caller: Caller | None = None
    ) -> DatasetStatus:
        """One dataset's budget, spent, reserved and remaining epsilon, and its active jobs.

        With `pld_may_be_pending`, answer at once: if the PLD epsilon of new
        commits is not computed yet, `spent_epsilon` is their RDP epsilon,
        labelled "rdp" (see `budget_figures`).
        """
        caller = self._caller(caller)
        with self._transactions.read() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset, shared=True)
            rows = read_status(self._tables, connection, caller, row)
        return self._status(caller, rows, pld_may_be_pending)

    def list_datasets(
        self, pld_may_be_pending: bool = False, *, caller: Caller | None = None
    ) -> list[DatasetStatus]:
        """Every dataset the caller may see (its own; all for an admin), by tenant and name (see get_budget)."""
        caller = self._caller(caller)
        with self._transactions.read() as connection:
            datasets = self._tables.datasets.listed(connection, None if caller.admin else caller.tenant)
            all_rows = [read_status(self._tables, connection, caller, row) for row in datasets]
        return [self._status(caller, rows, pld_may_be_pending) for rows in all_rows]

    # ------------------------------------------------------------ jobs

    def list_jobs(
        self, dataset: str | None = None, state: str | None = None, charges: bool = False, *,
        caller: Caller | None = None,
    ) -> list[Reservation]:
        """Reservations on the caller's datasets, oldest first; optionally of one dataset or state.

        With `charges`, each carries what it took from each budget it is
        charged to (records.JobCharge), replayed from the whole history of
        its dataset, every tenant's: a listing whose time grows with that
        history, where one without them follows what it lists.
        """
        caller = self._caller(caller)
        state = check_state(state)
        with self._transactions.read() as connection:
            dataset_id = (
                visible_dataset(self._tables, connection, caller, dataset, shared=True).dataset_id
                if dataset is not None else None
            )
            rows = self._tables.reservations.listed(
                connection, dataset_id, None if caller.admin else caller.tenant, state
            )
            replayed = self._job_charges(connection, {row.dataset_id for row in rows}) if charges else {}
        return [
            replace(row.reservation(caller), charges=replayed.get(row.reservation_id)) if charges else
            row.reservation(caller)
            for row in rows
        ]

    def _job_charges(self, connection: Connection, dataset_ids: set[int]) -> dict[str, tuple[JobCharge, ...]]:
        """`job_charges` of every job on the datasets `dataset_ids`, by reservation id."""
        replayed = {}
        for dataset_id in sorted(dataset_ids):
            dataset = self._tables.datasets.by_id(connection, dataset_id)
            blocks = self._tables.datasets.blocks(connection, dataset_id)
            entries = self._history.of_budgets(connection, [dataset_id, *(block.dataset_id for block in blocks)])
            replayed.update(job_charges(entries, dataset.stored(), [block.stored() for block in blocks]))
        return replayed

    # ------------------------------------------------------------ plans

    def register_plan(
        self,
        dataset: str,
        plan: str,
        jobs: list[EventsLike] | tuple[EventsLike, ...],
        delta: float | None = None,
        privacy_unit: str = EXAMPLE,
        rows_per_person: int | None = None,
        *,
        caller: Caller | None = None,
    ) -> PlanStatus:
        """Pre-register `plan`: `jobs`, each one's planned events in the order they will run, all fixed before any
        runs. The dataset's plan pool is charged now, once, the PLD epsilon of all of them composed at `delta`
        (default a tenth of the pool's delta), or BudgetExceeded when the pool's plans would then pass its epsilon
        or delta (basic composition; docs/ledger.md proves the rule).

        Its jobs then reserve with `plan`, one after another, each with the
        events the plan declared for it (any other is refused), and take
        nothing from the filter: they were paid for here. Stopping early is
        the tenant's choice at any point; the jobs that never start are not
        refunded. Only the dataset's owner registers plans, on a dataset
        without blocks. Events of `privacy_unit` are charged as `reserve`
        charges them (`charged_plan`).
        """
        caller = self._caller(caller)
        check_name("plan", plan)
        if not isinstance(jobs, (list, tuple)) or not jobs:
            raise InvalidArgument("a plan needs one or more jobs, each its planned events")
        if len(jobs) > MAX_PLAN_JOBS:
            raise InvalidArgument(f"a plan holds at most {MAX_PLAN_JOBS} jobs (got {len(jobs)})")
        _, charged, _, rule = self._charged_jobs(caller, dataset, jobs, privacy_unit, rows_per_person)
        # Its PLD composes every step of every job: costed as commits of as many steps are, before any work.
        self._charge_curves(caller, 1 + sum(job.steps for job in charged) / COMPOSED_STEPS_PER_UNIT)
        refuse_without_pool(dataset, plan, rule)
        delta = check_plan_delta(rule, delta)
        epsilon = plan_epsilon(charged, delta)  # the costly part, outside the write lock
        with self._transactions.change() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset, shared=True)
            tenant = job_tenant(caller, row)
            if tenant != row.tenant:
                raise PermissionDenied(
                    f"plans are charged to a dataset's own plan pool, and dataset {dataset!r} is tenant "
                    f"{row.tenant!r}'s; another tenant runs its jobs through the filter, within its quota"
                )
            if self._tables.datasets.blocks(connection, row.dataset_id):
                raise FailedPrecondition(
                    f"dataset {dataset!r} is made of blocks, and a plan is charged to the dataset's own pool; run "
                    "its jobs on the blocks through their filters"
                )
            if self._tables.plans.by_name(connection, row.dataset_id, plan) is not None:
                raise AlreadyExists(f"dataset {dataset!r} already has a plan {plan!r}; name the new one otherwise")
            used = self._tables.plans.pool_use(connection, row.dataset_id)
            check_pool_admits(dataset, plan, row.rule(), used, epsilon, delta)
            self._tables.plans.insert(connection, row.dataset_id, plan, tenant, plan_jobs_json(charged), epsilon, delta)
            self._history.record(connection, caller, "register_plan", tenant, row.dataset_id, {
                "plan": plan, "jobs": [job.to_dict() for job in charged], "epsilon": epsilon, "delta": delta,
            })
            registered = self._tables.plans.by_name(connection, row.dataset_id, plan)
        return registered.status(caller)

    def list_plans(self, dataset: str, *, caller: Caller | None = None) -> list[PlanStatus]:
        """The dataset's pre-registered plans the caller may see (an admin: all; a tenant: its own), oldest
        first."""
        caller = self._caller(caller)
        with self._transactions.read() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset, shared=True)
            rows = self._tables.plans.of_dataset(connection, row.dataset_id, None if caller.admin else caller.tenant)
        return [plan.status(caller) for plan in rows]

    @curves_outside_lock
    def reserve(
        self,
        dataset: str,
        job_id: str,
        planned: EventsLike,
        lease_seconds: float | None = None,
        privacy_unit: str = EXAMPLE,
        rows_per_person: int | None = None,
        blocks: tuple[str, ...] | list[str] = (),
        plan: str | None = None,
        *,
        caller: Caller | None = None,
    ) -> Reservation:
        """Hold budget for all of a job's planned events, or raise BudgetExceeded.

        `planned` protects `privacy_unit`; on a dataset of the other unit it
        is converted or refused by `charged_plan` (an example-level job on a
        user-level dataset is charged its group-privacy bound for people of at
        most `rows_per_person` rows), and the reservation holds the events
        charged. The job is charged to the dataset, or in full to each of
        `blocks` (block composition): every budget's admission rule, and the
        tenant's quota on each where one is set, must admit it; all or
        nothing. A job id holds at most one active reservation per dataset
        and tenant: asking again with the same plan and blocks returns that
        reservation (a retried reserve holds budget once); a different one is
        refused until it is released. With `lease_seconds`, the reservation
        expires that long after this call or its last commit, and its unrun
        steps are released. With `plan`, the job is the next job of that
        pre-registered plan (`register_plan`): its events must be the ones
        the plan declared for it, and it is admitted without the filter.
        """
        caller = self._caller(caller)
        check_name("job id", job_id)
        if plan is not None:
            check_name("plan", plan)
        blocks = check_block_names(blocks)
        lease_seconds = check_lease_seconds(lease_seconds)
        job_events, planned, rows_per_person = self._charged(caller, dataset, planned, privacy_unit, rows_per_person)
        # A job of a plan takes nothing from the filter, so it needs no RDP curve.
        planned_tally = RdpTally.zero()
        if plan is None:
            self._charge_curves(caller, uncached_mechanisms(planned))
            planned_tally = RdpTally.of(planned)  # the costly part, outside the write lock
        with self._transactions.change() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset, shared=True)
            job = JobRequest(job_tenant(caller, row), job_id, blocks, planned, planned_tally, lease_seconds)
            expire_leases(self._tables, connection, row.dataset_id)
            existing = self._tables.reservations.active_of_job(connection, row.dataset_id, job.tenant, job_id)
            if existing is not None:
                reservation = existing.reservation(caller)
                if reservation.planned != planned or reservation.blocks != blocks or reservation.plan != plan:
                    raise FailedPrecondition(
                        f"job {job_id!r} already holds reservation {reservation.reservation_id} on dataset "
                        f"{dataset!r} with another plan or blocks; release it first or use another job id"
                    )
                return reservation
            if plan is not None:
                reservation_id = admission.hold_in_plan(self._tables, connection, caller, dataset, row, job, plan)
                return self._tables.reservations.by_id(connection, reservation_id).reservation(caller)
            budgets = admission.budget_rows(self._tables, connection, row, blocks, dataset, new_job=True)
            reservation_id = admission.hold(
                self._tables, connection, caller, dataset, row, budgets, job,
                admission.conversion(planned, job_events, rows_per_person),
            )
            self._tables.datasets.count_arrival(connection, budgets)
            queueing.serve_queue(self._tables, connection, row.dataset_id)
            reserved = self._tables.reservations.by_id(connection, reservation_id)
        return reserved.reservation(caller)

    def _charged(
        self, caller: Caller, dataset: str, planned: EventsLike, privacy_unit: str, rows_per_person: int | None
    ) -> tuple[Composition, Composition, int | None]:
        """A job's own events, the events the dataset charges for them (see `charged_plan`), and the checked bound."""
        (job_events,), (charged,), rows_per_person, _ = self._charged_jobs(
            caller, dataset, [planned], privacy_unit, rows_per_person
        )
        return job_events, charged, rows_per_person

    def _charged_jobs(
        self, caller: Caller, dataset: str, jobs: list[EventsLike] | tuple[EventsLike, ...], privacy_unit: str,
        rows_per_person: int | None,
    ) -> tuple[list[Composition], list[Composition], int | None, AdmissionRule]:
        """`_charged` of each of `jobs`, from one read of the dataset; and the dataset's admission rule."""
        job_events = [check_plan(planned) for planned in jobs]
        privacy_unit = check_privacy_unit(privacy_unit)
        rows_per_person = check_rows_per_person(rows_per_person)
        with self._transactions.read() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset, shared=True)
        charged = [charged_plan(dataset, row.privacy_unit, privacy_unit, events, rows_per_person)
                   for events in job_events]
        return job_events, charged, rows_per_person, row.rule()

    def refuse_while_limited(self, caller: Caller) -> None:
        """Raise RateLimited when the tenant's bucket of costly requests is empty (a server, before it parses a
        Fits: a tenant that keeps asking costs it next to nothing)."""
        if self.curve_limits is not None and not caller.admin and self.curve_limits.owes(f"tenant {caller.tenant!r}"):
            self._charge_curves(caller, 1)

    def _charge_curves(self, caller: Caller, cost: float) -> None:
        """Take `cost` from the tenant's bucket of costly requests (`curve_limits`), or raise RateLimited.

        A request costs one per mechanism whose RDP curve it would compute,
        and a Fits one more, a commit one per COMPOSED_STEPS_PER_UNIT steps,
        a plan's registration one more than a commit of all its jobs' steps,
        taken before it does any work. Admins are not charged.
        """
        if self.curve_limits is not None and not caller.admin:
            self.curve_limits.take(f"tenant {caller.tenant!r}", cost)

    @curves_outside_lock
    def commit(
        self, reservation_id: str, steps: int, sequence: int, *, caller: Caller | None = None
    ) -> CommitResult:
        """Charge the next `steps` planned steps of a reservation (in plan order) as spent; renew its lease.

        Idempotent per `sequence`: a retry with the same sequence and steps
        charges nothing more and returns the first result; the same sequence
        with other steps is refused. A reservation whose lease expired takes
        no new commit (FailedPrecondition).
        """
        caller = self._caller(caller)
        steps = check_steps(steps)
        sequence = check_sequence(sequence)
        self._charge_curves(caller, steps / COMPOSED_STEPS_PER_UNIT)
        with self._transactions.change() as connection:
            row = visible_reservation(self._tables, connection, caller, reservation_id)
            if row.state == ACTIVE and row.expires_at is not None and row.expires_at <= now():  # its lease ran out
                expire_leases(self._tables, connection, row.dataset_id)
                row = visible_reservation(self._tables, connection, caller, reservation_id)
            reservation = row.reservation(caller)
            # The reservation and its lease first: a retried sequence does not let a driver that lost its lease,
            # or whose job was released, learn or assume that its charges still stand.
            if reservation.lease_expired:
                raise FailedPrecondition(
                    f"the lease of reservation {reservation_id} expired at {reservation.expires_at} and its unrun "
                    "steps were released, so it takes no more commits; stop the job's steps and reserve again"
                )
            if reservation.state != ACTIVE:
                raise FailedPrecondition(
                    f"reservation {reservation_id} was released; reserve again for more steps"
                )
            earlier = self._tables.reservations.commit_of(connection, reservation_id, sequence)
            if earlier is not None:
                if earlier.steps != steps:
                    raise InvalidArgument(
                        f"sequence {sequence} of reservation {reservation_id} was committed with {earlier.steps} "
                        f"steps (got {steps}); a retry must repeat the same steps, a new block needs a new sequence"
                    )
                return CommitResult(reservation_id, sequence, steps, earlier.committed_steps, reservation.planned_steps)
            if steps > reservation.unrun_steps:
                raise InvalidArgument(
                    f"reservation {reservation_id} has {reservation.unrun_steps} unrun steps of "
                    f"{reservation.planned_steps} (got {steps}); commit at most that, or reserve a new plan"
                )
            committed_steps = admission.charge(self._tables, connection, caller, row, sequence, steps)
        self._composition.committed(row.dataset_id)
        return CommitResult(reservation_id, sequence, steps, committed_steps, reservation.planned_steps)

    @curves_outside_lock
    def release(self, reservation_id: str, *, caller: Caller | None = None) -> Reservation:
        """Free a reservation's unrun steps; committed steps stay spent. Releasing twice is a no-op."""
        caller = self._caller(caller)
        with self._transactions.change() as connection:
            row = visible_reservation(self._tables, connection, caller, reservation_id)
            expire_leases(self._tables, connection, row.dataset_id)
            admission.free(
                self._tables, connection, caller, visible_reservation(self._tables, connection, caller, reservation_id),
                "release",
            )
            queueing.serve_queue(self._tables, connection, row.dataset_id)
            row = visible_reservation(self._tables, connection, caller, reservation_id)
        return row.reservation(caller)

    @curves_outside_lock
    def expire_leases(self) -> None:
        """Release the unrun steps of every reservation whose lease ran out (a server calls this every second).

        Looks first on a reader, so a sweep that finds nothing writes nothing and waits for no fsync.
        """
        with self._transactions.read() as connection:
            due = self._tables.reservations.any_expired(connection)
        if due:
            with self._transactions.change() as connection:
                expire_leases(self._tables, connection, None)

    # ------------------------------------------------------------ the queue

    @curves_outside_lock
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
        *,
        caller: Caller | None = None,
    ) -> QueuedJob:
        """Queue a job for budget; the dataset's scheduling policy admits it when it fits (at once if it does).

        Admitted, it holds a reservation like `reserve` gives (`lease_seconds`
        as there). Higher `priority` is served first. With
        `max_wait_seconds`, it gives up waiting that long after now. A plan
        that could never fit, even with every reservation released, is
        refused at once (BudgetExceeded). Queueing the same job id and plan
        again returns the same entry; another plan is refused while it waits.
        `privacy_unit`, `rows_per_person` and `blocks` as in `reserve`: the
        queue holds the events charged, and a job on blocks waits for each.
        Only the dataset's owner (or an admin) queues on it.
        """
        caller = self._caller(caller)
        check_name("job id", job_id)
        blocks = check_block_names(blocks)
        lease_seconds = check_lease_seconds(lease_seconds)
        priority = check_priority(priority)
        max_wait_seconds = check_max_wait_seconds(max_wait_seconds)
        job_events, planned, rows_per_person = self._charged(caller, dataset, planned, privacy_unit, rows_per_person)
        self._charge_curves(caller, uncached_mechanisms(planned))
        planned_tally = RdpTally.of(planned)
        with self._transactions.change() as connection:
            row = visible_dataset(self._tables, connection, caller, dataset)
            job = JobRequest(job_tenant(caller, row), job_id, blocks, planned, planned_tally, lease_seconds)
            expire_leases(self._tables, connection, row.dataset_id)
            earlier = queueing.same_job_queued(self._tables, connection, caller, dataset, row, job_id, planned)
            if earlier is not None:
                return earlier
            queue_id = queueing.queue_job(
                self._tables, connection, caller, dataset, row, job, priority, max_wait_seconds,
                admission.conversion(planned, job_events, rows_per_person),
            )
            queueing.serve_queue(self._tables, connection, row.dataset_id)
            queued = visible_queued_job(self._tables, connection, caller, queue_id).queued_job(caller)
        return queued

    @curves_outside_lock
    def queued_job(self, queue_id: str, *, caller: Caller | None = None) -> QueuedJob:
        """A queued job as it stands now; a waiting one is scheduled first, so time-based unlocking shows."""
        caller = self._caller(caller)
        with self._transactions.change() as connection:
            row = visible_queued_job(self._tables, connection, caller, queue_id)
            if row.state == QUEUED:
                expire_leases(self._tables, connection, row.dataset_id)
                queueing.serve_queue(self._tables, connection, row.dataset_id)
                row = visible_queued_job(self._tables, connection, caller, queue_id)
        return row.queued_job(caller)

    @curves_outside_lock
    def cancel_queued(self, queue_id: str, *, caller: Caller | None = None) -> QueuedJob:
        """Take a waiting job out of the queue; a job already admitted holds a reservation: release that instead."""
        caller = self._caller(caller)
        with self._transactions.change() as connection:
            row = visible_queued_job(self._tables, connection, caller, queue_id)
            if row.state == ADMITTED:
                raise FailedPrecondition(
                    f"queued job {queue_id} was already admitted as reservation {row.reservation_id}; release that "
                    "instead (dpfleet ledger release)"
                )
            if row.state == QUEUED:
                self._tables.queue.end(connection, queue_id, CANCELLED, now(), f"cancelled by {caller.actor}")
                self._history.record(
                    connection, caller, "cancel_queued", row.dataset_tenant, row.dataset_id,
                    {"queue_id": queue_id, "job_id": row.job_id},
                )
                queueing.serve_queue(self._tables, connection, row.dataset_id)
                row = visible_queued_job(self._tables, connection, caller, queue_id)
        return row.queued_job(caller)

    def list_queued(
        self, dataset: str | None = None, state: str | None = QUEUED, *, caller: Caller | None = None
    ) -> list[QueuedJob]:
        """Queued jobs on the caller's datasets (waiting ones by default), by dataset then queue position."""
        caller = self._caller(caller)
        state = check_queue_state(state)
        with self._transactions.read() as connection:
            if dataset is not None:
                # Only the owner (or an admin) names a dataset here: its queue shows every tenant's jobs.
                dataset_id, owner = visible_dataset(self._tables, connection, caller, dataset).dataset_id, None
            else:
                dataset_id, owner = None, None if caller.admin else caller.tenant
            rows = self._tables.queue.listed(connection, dataset_id, owner, state)
        return [row.queued_job(caller) for row in rows]

    @curves_outside_lock
    def serve_queues(self) -> None:
        """Serve every dataset with waiting jobs, for unlocking over time and deadlines (a server: every second).

        Looks first on a reader, so a sweep with nothing queued writes nothing.
        """
        with self._transactions.read() as connection:
            waiting = self._tables.queue.datasets_waiting(connection)
        if waiting:
            with self._transactions.change() as connection:
                for dataset_id in waiting:
                    queueing.serve_queue(self._tables, connection, dataset_id)

    # ------------------------------------------------------------ the history

    def head(self, signing_key: Ed25519PrivateKey | None = None, *, caller: Caller | None = None) -> SignedHead:
        """The history's head (entries, last hash, now) signed with the history key, or with the Ed25519
        `signing_key` for tenants to check with its public key, to keep elsewhere (admin only)."""
        caller = self._caller(caller)
        require_admin(caller, "the signed head needs the admin (dpfleet ledger head runs on the file)")
        with self._transactions.read() as connection:
            entries, last_hash = self._history.head(connection)
        return sign_head(signing_key or self._history.key, entries, last_hash, now())

    def verify(
        self,
        head: SignedHead | None = None,
        full: bool = False,
        head_public_key: Ed25519PublicKey | None = None,
        *,
        caller: Caller | None = None,
    ) -> Verification:
        """Check the history's keyed hash chain, replay every dataset's, block's, tenant use's, reservation's,
        commit's and tenant's history against its row, and with `head` check that the history extends it
        (admin only). An Ed25519-signed head is checked with `head_public_key`, which an HMAC-signed one fails.

        Every entry's hash is checked each time. The replays start from the
        state the last verify that found nothing kept (its HMAC and anchor
        checked: see verification.verified), so they cost what was recorded
        since; `full` replays from the first entry. A verify that finds
        nothing keeps its state for the next.
        """
        caller = self._caller(caller)
        require_admin(caller, "verifying the ledger needs the admin (dpfleet ledger verify runs on the file)")
        with self._transactions.read() as connection:
            stored = read_stored(self._tables, connection)
        verification, state = verify_stored(stored, self._history.key, head, full, head_public_key)
        if state is not None:
            # A read-only or unreachable database keeps the state it had: the next verify replays more.
            with contextlib.suppress(LedgerUnavailable):
                with self._transactions.change() as connection:
                    keep_verified_state(connection, state, self._history.key)
        return verification

    def history(
        self, dataset: str | None = None, limit: int = 1000, *, caller: Caller | None = None
    ) -> list[HistoryEntry]:
        """The newest `limit` changes the caller may see (its tenant's; all for an admin), oldest first."""
        caller = self._caller(caller)
        limit = check_history_limit(limit)
        with self._transactions.read() as connection:
            dataset_id = (
                visible_dataset(self._tables, connection, caller, dataset, shared=True).dataset_id
                if dataset is not None else None
            )
            entries = self._history.listed(connection, dataset_id, None if caller.admin else caller.tenant, limit)
        return [entry.entry(caller, self._history.shown_id(caller, entry.entry_id)) for entry in entries]


def open_embedded_ledger(path: str | os.PathLike | None = None) -> Ledger:
    """The single-machine ledger: the local user is admin and owns the tenant 'local'.

    `path` defaults to `default_ledger_path()`; its folder is created.
    """
    path = Path(path) if path is not None else default_ledger_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    caller = Caller(actor=f"{local_user()} (embedded)", tenant=LOCAL_TENANT, admin=True)
    ledger = Ledger(path, caller=caller)
    ledger._ensure_tokenless_tenant(LOCAL_TENANT, caller)
    return ledger
