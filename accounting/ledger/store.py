"""The ledger's SQLite store and `Ledger`, the embedded ledger (store + core).

Durability: WAL journal with synchronous=FULL, so a change is on disk when
its transaction returns; every state change is one BEGIN IMMEDIATE
transaction, which also serialises writers across processes sharing the file.
Reads run on a pool of connections of their own, beside writes and beside
each other.
Each change appends a row to `history` (who, when, what, JSON details); the
table refuses UPDATE and DELETE.

Datasets belong to tenants. A caller names a dataset 'name' within its own
tenant or 'tenant/name'; only admins may use another tenant's prefix. A tenant
asking for another tenant's dataset or reservation, or one that does not
exist, gets the same PermissionDenied, so existence is never revealed; an
admin gets NotFound for what does not exist.

Each dataset row carries its committed events in canonical form (one record
per mechanism) and the exact RDP tally (see core.RdpTally) of committed +
reserved-unrun steps, so admission and status never read the history; a
commit only rewrites the committed events, which the RDP and PLD figures of
what is spent are computed from.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
import secrets
import sqlite3
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from accounting.events import Composition, EventsLike
from accounting.ledger.core import (
    ACTIVE,
    LOCAL_TENANT,
    RELEASED,
    AlreadyExists,
    Caller,
    CommitResult,
    DatasetRef,
    DatasetStatus,
    FailedPrecondition,
    HistoryEntry,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RdpTally,
    Reservation,
    TenantCreated,
    Unauthenticated,
    budget_figures,
    canonical,
    check_admission,
    check_budget_epsilon,
    check_delta,
    check_history_limit,
    check_name,
    check_new_budget,
    check_plan,
    check_sequence,
    check_state,
    check_steps,
    display_name,
    hash_token,
    new_token,
    no_access,
    no_reservation,
    resolve_dataset,
    split_steps,
    tenant_caller,
    token_key_id,
    token_matches,
)

SCHEMA_VERSION = 2

_SCHEMA = (
    "CREATE TABLE schema_version (version INTEGER NOT NULL)",
    """CREATE TABLE tenants (
        name TEXT PRIMARY KEY,
        key_id TEXT UNIQUE,
        token_salt BLOB,
        token_hash BLOB,
        created_at TEXT NOT NULL
    )""",
    """CREATE TABLE datasets (
        id INTEGER PRIMARY KEY,
        tenant TEXT NOT NULL REFERENCES tenants(name),
        name TEXT NOT NULL,
        budget_epsilon REAL NOT NULL,
        delta REAL NOT NULL,
        held_rdp TEXT NOT NULL,
        committed_events TEXT NOT NULL,
        created_at TEXT NOT NULL,
        released_jobs INTEGER NOT NULL DEFAULT 0,
        UNIQUE (tenant, name)
    )""",
    """CREATE TABLE reservations (
        id TEXT PRIMARY KEY,
        dataset_id INTEGER NOT NULL REFERENCES datasets(id),
        job_id TEXT NOT NULL,
        planned_events TEXT NOT NULL,
        committed_steps INTEGER NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('active', 'released')),
        created_at TEXT NOT NULL,
        released_at TEXT
    )""",
    "CREATE UNIQUE INDEX one_active_reservation_per_job ON reservations (dataset_id, job_id) WHERE state = 'active'",
    "CREATE INDEX reservations_by_dataset ON reservations (dataset_id, state)",
    """CREATE TABLE commits (
        reservation_id TEXT NOT NULL REFERENCES reservations(id),
        sequence INTEGER NOT NULL,
        steps INTEGER NOT NULL,
        committed_steps INTEGER NOT NULL,
        at TEXT NOT NULL,
        PRIMARY KEY (reservation_id, sequence)
    )""",
    """CREATE TABLE history (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at TEXT NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        tenant TEXT,
        dataset_id INTEGER REFERENCES datasets(id),
        details TEXT NOT NULL
    )""",
    "CREATE INDEX history_by_tenant ON history (tenant, id)",
    "CREATE INDEX history_by_dataset ON history (dataset_id, id)",
    """CREATE TRIGGER history_is_append_only_update BEFORE UPDATE ON history
        BEGIN SELECT RAISE(ABORT, 'the ledger history is append-only'); END""",
    """CREATE TRIGGER history_is_append_only_delete BEFORE DELETE ON history
        BEGIN SELECT RAISE(ABORT, 'the ledger history is append-only'); END""",
)

# Each version's statements bring a file of the previous version up to it, in the transaction that opens it.
_MIGRATIONS = {
    # A count of released jobs per dataset, so a status reads one row, not an index of every job it ever had.
    2: (
        "ALTER TABLE datasets ADD COLUMN released_jobs INTEGER NOT NULL DEFAULT 0",
        "UPDATE datasets SET released_jobs = "
        "(SELECT COUNT(*) FROM reservations r WHERE r.dataset_id = datasets.id AND r.state = 'released')",
    ),
}

_DATASET_COLUMNS = "id, tenant, name, budget_epsilon, delta, held_rdp, committed_events, released_jobs"
_RESERVATION_COLUMNS = (
    "r.id, d.tenant, d.name, r.job_id, r.state, r.planned_events, r.committed_steps, r.created_at, r.released_at"
)


# Changes grouped into one transaction at most; bounds the wait of the first of them.
_MAX_BATCH = 64


class _Batch:
    """Changes sharing one transaction; `committed` is set once its COMMIT returned (or failed: `error`)."""

    def __init__(self) -> None:
        self.changes = 0
        self.committed = threading.Event()
        self.error: BaseException | None = None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def default_ledger_path() -> Path:
    """The embedded ledger file: $DPFLEET_HOME/ledger.db, else ~/.local/share/dpfleet/ledger.db."""
    home = os.environ.get("DPFLEET_HOME")
    base = Path(home) if home else Path.home() / ".local" / "share" / "dpfleet"
    return base / "ledger.db"


def _connect(path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode.lower() != "wal":
        connection.close()
        raise FailedPrecondition(
            f"the ledger file {path} cannot use SQLite's WAL journal (got {mode!r}); put it on a local disk"
        )
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute("PRAGMA foreign_keys=ON")
    return connection


class Ledger:
    """The privacy ledger on one SQLite file: the embedded ledger, and what the gRPC server serves.

    Every method takes the `caller` it acts for; it defaults to the caller
    the ledger was opened with (the local admin for `open_embedded_ledger`).
    Safe to share between threads; several processes may open the same file.
    """

    def __init__(self, path: str | os.PathLike, caller: Caller | None = None) -> None:
        self.path = Path(path)
        self._default_caller = caller
        self._writer = _connect(self.path)
        self._write_lock = threading.Lock()
        self._writers_waiting = 0
        self._waiting_lock = threading.Lock()
        self._batch: _Batch | None = None
        self._idle_readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False
        self._verified_tokens: dict[bytes, str] = {}
        try:
            self._create_or_check_schema()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file; a read in progress finishes first on its own connection, which closes after it."""
        with self._write_lock, self._readers_lock:
            self._closed = True
            for reader in self._idle_readers:
                reader.close()
            self._idle_readers.clear()
            self._writer.close()

    # ------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One state change, in its own savepoint; on success, returns only once it is durable.

        Group commit: changes that queue up while one transaction is being
        committed (fsync'd) run one after another in the next transaction,
        each in a savepoint, and the last of them commits it. A change that
        fails rolls back its savepoint and raises at once; a change that
        succeeds waits until the COMMIT of its transaction has returned.
        """
        with self._waiting_lock:
            self._writers_waiting += 1
        self._write_lock.acquire()
        with self._waiting_lock:
            self._writers_waiting -= 1
        batch = None
        try:
            if self._batch is None:
                self._writer.execute("BEGIN IMMEDIATE")
                self._batch = _Batch()
            self._writer.execute("SAVEPOINT change")
            try:
                yield self._writer
            except BaseException:
                self._writer.execute("ROLLBACK TO change")
                self._writer.execute("RELEASE change")
                raise
            self._writer.execute("RELEASE change")
            batch = self._batch
            batch.changes += 1
        finally:
            if self._batch is not None and (self._writers_waiting == 0 or self._batch.changes >= _MAX_BATCH):
                self._commit_batch()
            self._write_lock.release()
        batch.committed.wait()
        if batch.error is not None:
            raise batch.error

    def _commit_batch(self) -> None:
        batch, self._batch = self._batch, None
        try:
            self._writer.execute("COMMIT")
        except BaseException as error:
            if self._writer.in_transaction:
                self._writer.execute("ROLLBACK")
            batch.error = error
        batch.committed.set()

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A snapshot of what is committed, on a connection of its own (WAL lets reads run beside writes)."""
        with self._readers_lock:
            if self._closed:
                raise sqlite3.ProgrammingError(f"the ledger {self.path} is closed")
            reader = self._idle_readers.pop() if self._idle_readers else None
        if reader is None:
            reader = _connect(self.path)
        try:
            reader.execute("BEGIN")
            try:
                yield reader
            finally:
                reader.execute("COMMIT")
        finally:
            with self._readers_lock:
                if self._closed:
                    reader.close()
                else:
                    self._idle_readers.append(reader)

    def _create_or_check_schema(self) -> None:
        with self._transaction() as connection:
            exists = connection.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
            ).fetchone()
            if not exists:
                for statement in _SCHEMA:
                    connection.execute(statement)
                connection.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                return
            (version,) = connection.execute("SELECT version FROM schema_version").fetchone()
            if version < SCHEMA_VERSION:
                self._migrate(connection, version)
                return
        if version != SCHEMA_VERSION:
            raise FailedPrecondition(
                f"the ledger file {self.path} has schema version {version}; this dpfleet reads versions up to "
                f"{SCHEMA_VERSION}. Open it with the dpfleet version that wrote it, or a newer one"
            )

    def _migrate(self, connection: sqlite3.Connection, version: int) -> None:
        """Bring a file of an older schema version up to SCHEMA_VERSION, recorded in its history."""
        for target in range(version + 1, SCHEMA_VERSION + 1):
            for statement in _MIGRATIONS[target]:
                connection.execute(statement)
        connection.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        caller = self._default_caller or Caller(actor=f"{_local_user()} (opening the file)", tenant=None)
        self._record(connection, caller, "migrate_schema", None, None, {"from": version, "to": SCHEMA_VERSION})

    def _caller(self, caller: Caller | None) -> Caller:
        caller = caller or self._default_caller
        if caller is None:
            raise Unauthenticated("no caller given; open the ledger with a caller or pass one")
        return caller

    @staticmethod
    def _record(
        connection: sqlite3.Connection,
        caller: Caller,
        action: str,
        tenant: str | None,
        dataset_id: int | None,
        details: dict,
    ) -> None:
        connection.execute(
            "INSERT INTO history (at, actor, action, tenant, dataset_id, details) VALUES (?, ?, ?, ?, ?, ?)",
            (_now(), caller.actor, action, tenant, dataset_id, json.dumps(details, sort_keys=True)),
        )

    @staticmethod
    def _dataset_row(connection: sqlite3.Connection, caller: Caller, reference: str) -> tuple:
        dataset = resolve_dataset(caller, reference)
        row = connection.execute(
            f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE tenant = ? AND name = ?", (dataset.tenant, dataset.name)
        ).fetchone()
        if row is None:
            if caller.admin:
                raise NotFound(f"dataset {reference!r} does not exist; create it with dpfleet ledger dataset create")
            raise no_access(reference)
        return row

    @staticmethod
    def _reservation_row(connection: sqlite3.Connection, caller: Caller, reservation_id: str) -> tuple:
        check_name("reservation id", reservation_id)
        row = connection.execute(
            f"SELECT {_RESERVATION_COLUMNS}, r.dataset_id FROM reservations r "
            "JOIN datasets d ON d.id = r.dataset_id WHERE r.id = ?",
            (reservation_id,),
        ).fetchone()
        if row is None and caller.admin:
            raise NotFound(f"reservation {reservation_id!r} does not exist (dpfleet ledger jobs lists them)")
        if row is None or not (caller.admin or row[1] == caller.tenant):
            raise no_reservation(reservation_id)
        return row

    @staticmethod
    def _reservation(caller: Caller, row: tuple) -> Reservation:
        reservation_id, tenant, name, job_id, state, planned, committed, created_at, released_at = row[:9]
        return Reservation(
            reservation_id=reservation_id,
            dataset=display_name(caller, DatasetRef(tenant, name)),
            job_id=job_id,
            state=state,
            planned=Composition.from_json(planned),
            committed_steps=committed,
            created_at=created_at,
            released_at=released_at,
        )

    @staticmethod
    def _status_rows(connection: sqlite3.Connection, row: tuple) -> tuple[tuple, list[tuple]]:
        """What a status needs from the file: read inside a transaction, computed on outside it."""
        jobs = connection.execute(
            f"SELECT {_RESERVATION_COLUMNS} FROM reservations r JOIN datasets d ON d.id = r.dataset_id "
            "WHERE r.dataset_id = ? AND r.state = ? ORDER BY r.rowid",
            (row[0], ACTIVE),
        ).fetchall()
        return row, jobs

    def _status(
        self, caller: Caller, rows: tuple[tuple, list[tuple]], pld_may_be_pending: bool = False
    ) -> DatasetStatus:
        # The PLD epsilon can take a second when the committed events changed; no lock is held here.
        (_, tenant, name, budget_epsilon, delta, held, committed_events, released), jobs = rows
        figures = budget_figures(
            budget_epsilon, delta, Composition.from_json(committed_events), RdpTally.from_json(held), pld_may_be_pending
        )
        return DatasetStatus(
            name=display_name(caller, DatasetRef(tenant, name)),
            tenant=tenant,
            budget_epsilon=budget_epsilon,
            delta=delta,
            spent_epsilon=figures.spent_epsilon,
            spent_epsilon_rdp=figures.spent_epsilon_rdp,
            reserved_epsilon=figures.reserved_epsilon,
            remaining_epsilon=figures.remaining_epsilon,
            jobs=tuple(self._reservation(caller, job) for job in jobs),
            released_jobs=released,
            spent_epsilon_accountant=figures.spent_epsilon_accountant,
        )

    def _ensure_tokenless_tenant(self, tenant: str, caller: Caller) -> None:
        with self._transaction() as connection:
            created = connection.execute(
                "INSERT OR IGNORE INTO tenants (name, created_at) VALUES (?, ?)", (tenant, _now())
            ).rowcount
            if created:
                self._record(connection, caller, "create_tenant", tenant, None, {"tenant": tenant, "token": False})

    # ------------------------------------------------------------ identity

    def authenticate(self, token: str) -> Caller:
        """The tenant a token belongs to; raises Unauthenticated for an unknown token.

        Verified tokens are remembered (as SHA-256 digests) for the life of
        this object, so only the first request of a tenant pays for scrypt.
        """
        digest = hashlib.sha256(token.encode()).digest()
        tenant = self._verified_tokens.get(digest)
        if tenant is None:
            key_id = token_key_id(token)
            with self._read() as connection:
                row = connection.execute(
                    "SELECT name, token_salt, token_hash FROM tenants WHERE key_id = ?", (key_id,)
                ).fetchone()
            if row is None or not token_matches(token, row[1], row[2]):
                raise Unauthenticated(
                    "the token is not known to this ledger; use the token dpfleet ledger tenant create printed"
                )
            tenant = row[0]
            self._verified_tokens[digest] = tenant
        return tenant_caller(tenant)

    def create_tenant(self, tenant: str, *, caller: Caller | None = None) -> TenantCreated:
        """Create a tenant and return its token, shown this once (admin only)."""
        caller = self._caller(caller)
        if not caller.admin:
            raise PermissionDenied(
                "creating a tenant needs the admin token (the server's --admin-token-file or DPFLEET_ADMIN_TOKEN)"
            )
        check_name("tenant name", tenant)
        key_id, token = new_token()
        salt = secrets.token_bytes(16)
        token_hash = hash_token(token, salt)
        with self._transaction() as connection:
            try:
                connection.execute(
                    "INSERT INTO tenants (name, key_id, token_salt, token_hash, created_at) VALUES (?, ?, ?, ?, ?)",
                    (tenant, key_id, salt, token_hash, _now()),
                )
            except sqlite3.IntegrityError:
                raise AlreadyExists(f"tenant {tenant!r} already exists; choose another name") from None
            self._record(connection, caller, "create_tenant", tenant, None, {"tenant": tenant, "key_id": key_id})
        return TenantCreated(tenant, token)

    # ------------------------------------------------------------ datasets

    def create_dataset(
        self, dataset: str, epsilon: float, delta: float, *, caller: Caller | None = None
    ) -> DatasetStatus:
        """Create a dataset with a budget of `epsilon` at `delta` for the whole life of the data."""
        caller = self._caller(caller)
        epsilon = check_budget_epsilon(epsilon)
        delta = check_delta(delta)
        reference = resolve_dataset(caller, dataset)
        zero = RdpTally.zero().to_json()
        with self._transaction() as connection:
            if not connection.execute("SELECT 1 FROM tenants WHERE name = ?", (reference.tenant,)).fetchone():
                raise NotFound(
                    f"tenant {reference.tenant!r} does not exist; create it with dpfleet ledger tenant create"
                )
            try:
                dataset_id = connection.execute(
                    "INSERT INTO datasets (tenant, name, budget_epsilon, delta, held_rdp, committed_events, "
                    "created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (reference.tenant, reference.name, epsilon, delta, zero, Composition().to_json(), _now()),
                ).lastrowid
            except sqlite3.IntegrityError:
                raise AlreadyExists(
                    f"dataset {dataset!r} already exists; an admin can raise its budget (dpfleet ledger dataset raise)"
                ) from None
            self._record(
                connection, caller, "create_dataset", reference.tenant, dataset_id, {"epsilon": epsilon, "delta": delta}
            )
            rows = self._status_rows(connection, self._dataset_row(connection, caller, dataset))
        return self._status(caller, rows)

    def raise_budget(self, dataset: str, epsilon: float, *, caller: Caller | None = None) -> DatasetStatus:
        """Set a dataset's budget epsilon (admin only); refused below what is committed and reserved."""
        caller = self._caller(caller)
        if not caller.admin:
            raise PermissionDenied(
                "changing a budget needs the admin token (the server's --admin-token-file or DPFLEET_ADMIN_TOKEN)"
            )
        epsilon = check_budget_epsilon(epsilon)
        with self._transaction() as connection:
            dataset_id, tenant, _, old_epsilon, delta, held = self._dataset_row(connection, caller, dataset)[:6]
            check_new_budget(dataset, epsilon, delta, RdpTally.from_json(held))
            connection.execute("UPDATE datasets SET budget_epsilon = ? WHERE id = ?", (epsilon, dataset_id))
            self._record(connection, caller, "raise_budget", tenant, dataset_id, {"from": old_epsilon, "to": epsilon})
            rows = self._status_rows(connection, self._dataset_row(connection, caller, dataset))
        return self._status(caller, rows)

    def get_budget(
        self, dataset: str, pld_may_be_pending: bool = False, *, caller: Caller | None = None
    ) -> DatasetStatus:
        """One dataset's budget, spent, reserved and remaining epsilon, and its active jobs.

        With `pld_may_be_pending`, answer at once: if the PLD epsilon of new
        commits is not computed yet, `spent_epsilon` is their RDP epsilon,
        labelled "rdp" (see `budget_figures`).
        """
        caller = self._caller(caller)
        with self._read() as connection:
            rows = self._status_rows(connection, self._dataset_row(connection, caller, dataset))
        return self._status(caller, rows, pld_may_be_pending)

    def list_datasets(
        self, pld_may_be_pending: bool = False, *, caller: Caller | None = None
    ) -> list[DatasetStatus]:
        """Every dataset the caller may see (its own; all for an admin), by tenant and name (see get_budget)."""
        caller = self._caller(caller)
        with self._read() as connection:
            if caller.admin:
                datasets = connection.execute(f"SELECT {_DATASET_COLUMNS} FROM datasets ORDER BY tenant, name")
            else:
                datasets = connection.execute(
                    f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE tenant = ? ORDER BY name", (caller.tenant,)
                )
            all_rows = [self._status_rows(connection, row) for row in datasets.fetchall()]
        return [self._status(caller, rows, pld_may_be_pending) for rows in all_rows]

    # ------------------------------------------------------------ jobs

    def list_jobs(
        self, dataset: str | None = None, state: str | None = None, *, caller: Caller | None = None
    ) -> list[Reservation]:
        """Reservations on the caller's datasets, oldest first; optionally of one dataset or state."""
        caller = self._caller(caller)
        state = check_state(state)
        conditions, parameters = [], []
        with self._read() as connection:
            if dataset is not None:
                conditions.append("r.dataset_id = ?")
                parameters.append(self._dataset_row(connection, caller, dataset)[0])
            elif not caller.admin:
                conditions.append("d.tenant = ?")
                parameters.append(caller.tenant)
            if state is not None:
                conditions.append("r.state = ?")
                parameters.append(state)
            where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
            rows = connection.execute(
                f"SELECT {_RESERVATION_COLUMNS} FROM reservations r JOIN datasets d ON d.id = r.dataset_id "
                f"{where} ORDER BY r.rowid",
                parameters,
            ).fetchall()
        return [self._reservation(caller, row) for row in rows]

    def reserve(
        self, dataset: str, job_id: str, planned: EventsLike, *, caller: Caller | None = None
    ) -> Reservation:
        """Hold budget for all of a job's planned events, or raise BudgetExceeded.

        A job id holds at most one active reservation per dataset: asking
        again with the same plan returns that reservation (a retried reserve
        holds budget once); a different plan is refused until it is released.
        """
        caller = self._caller(caller)
        check_name("job id", job_id)
        planned = check_plan(planned)
        planned_tally = RdpTally.of(planned)  # the costly part, outside the write lock
        with self._transaction() as connection:
            dataset_id, tenant, _, budget_epsilon, delta, held = self._dataset_row(connection, caller, dataset)[:6]
            existing = connection.execute(
                f"SELECT {_RESERVATION_COLUMNS} FROM reservations r JOIN datasets d ON d.id = r.dataset_id "
                "WHERE r.dataset_id = ? AND r.job_id = ? AND r.state = ?",
                (dataset_id, job_id, ACTIVE),
            ).fetchone()
            if existing is not None:
                reservation = self._reservation(caller, existing)
                if reservation.planned != planned:
                    raise FailedPrecondition(
                        f"job {job_id!r} already holds reservation {reservation.reservation_id} on dataset "
                        f"{dataset!r} with another plan; release it first or use another job id"
                    )
                return reservation
            held = RdpTally.from_json(held)
            total_epsilon = check_admission(dataset, budget_epsilon, delta, held, planned_tally)
            reservation_id = f"r-{secrets.token_hex(8)}"
            connection.execute(
                "INSERT INTO reservations (id, dataset_id, job_id, planned_events, committed_steps, state, created_at) "
                "VALUES (?, ?, ?, ?, 0, ?, ?)",
                (reservation_id, dataset_id, job_id, planned.to_json(), ACTIVE, _now()),
            )
            connection.execute(
                "UPDATE datasets SET held_rdp = ? WHERE id = ?", ((held + planned_tally).to_json(), dataset_id)
            )
            self._record(
                connection,
                caller,
                "reserve",
                tenant,
                dataset_id,
                {
                    "reservation_id": reservation_id,
                    "job_id": job_id,
                    "planned_events": planned.to_dict(),
                    "held_epsilon_rdp": total_epsilon,
                },
            )
            row = connection.execute(
                f"SELECT {_RESERVATION_COLUMNS} FROM reservations r JOIN datasets d ON d.id = r.dataset_id "
                "WHERE r.id = ?",
                (reservation_id,),
            ).fetchone()
        return self._reservation(caller, row)

    def commit(
        self, reservation_id: str, steps: int, sequence: int, *, caller: Caller | None = None
    ) -> CommitResult:
        """Charge the next `steps` planned steps of a reservation (in plan order) as spent.

        Idempotent per `sequence`: a retry with the same sequence and steps
        charges nothing more and returns the first result; the same sequence
        with other steps is refused.
        """
        caller = self._caller(caller)
        steps = check_steps(steps)
        sequence = check_sequence(sequence)
        with self._transaction() as connection:
            row = self._reservation_row(connection, caller, reservation_id)
            reservation = self._reservation(caller, row)
            dataset_id = row[9]
            earlier = connection.execute(
                "SELECT steps, committed_steps FROM commits WHERE reservation_id = ? AND sequence = ?",
                (reservation_id, sequence),
            ).fetchone()
            if earlier is not None:
                if earlier[0] != steps:
                    raise InvalidArgument(
                        f"sequence {sequence} of reservation {reservation_id} was committed with {earlier[0]} steps "
                        f"(got {steps}); a retry must repeat the same steps, a new block needs a new sequence"
                    )
                return CommitResult(reservation_id, sequence, steps, earlier[1], reservation.planned_steps)
            if reservation.state != ACTIVE:
                raise FailedPrecondition(
                    f"reservation {reservation_id} was released; reserve again for more steps"
                )
            if steps > reservation.unrun_steps:
                raise InvalidArgument(
                    f"reservation {reservation_id} has {reservation.unrun_steps} unrun steps of "
                    f"{reservation.planned_steps} (got {steps}); commit at most that, or reserve a new plan"
                )
            _, unrun = split_steps(reservation.planned, reservation.committed_steps)
            block, _ = split_steps(unrun, steps)
            (committed_events,) = connection.execute(
                "SELECT committed_events FROM datasets WHERE id = ?", (dataset_id,)
            ).fetchone()
            connection.execute(
                "UPDATE datasets SET committed_events = ? WHERE id = ?",
                (canonical(Composition.from_json(committed_events).then(block)).to_json(), dataset_id),
            )
            committed_steps = reservation.committed_steps + steps
            connection.execute(
                "UPDATE reservations SET committed_steps = ? WHERE id = ?", (committed_steps, reservation_id)
            )
            connection.execute(
                "INSERT INTO commits (reservation_id, sequence, steps, committed_steps, at) VALUES (?, ?, ?, ?, ?)",
                (reservation_id, sequence, steps, committed_steps, _now()),
            )
            self._record(
                connection,
                caller,
                "commit",
                row[1],
                dataset_id,
                {
                    "reservation_id": reservation_id,
                    "job_id": reservation.job_id,
                    "sequence": sequence,
                    "events": block.to_dict(),
                },
            )
        return CommitResult(reservation_id, sequence, steps, committed_steps, reservation.planned_steps)

    def release(self, reservation_id: str, *, caller: Caller | None = None) -> Reservation:
        """Free a reservation's unrun steps; committed steps stay spent. Releasing twice is a no-op."""
        caller = self._caller(caller)
        with self._transaction() as connection:
            row = self._reservation_row(connection, caller, reservation_id)
            reservation = self._reservation(caller, row)
            if reservation.state != ACTIVE:
                return reservation
            dataset_id = row[9]
            _, unrun = split_steps(reservation.planned, reservation.committed_steps)
            (held,) = connection.execute("SELECT held_rdp FROM datasets WHERE id = ?", (dataset_id,)).fetchone()
            connection.execute(
                "UPDATE datasets SET held_rdp = ?, released_jobs = released_jobs + 1 WHERE id = ?",
                ((RdpTally.from_json(held) - RdpTally.of(unrun)).to_json(), dataset_id),
            )
            connection.execute(
                "UPDATE reservations SET state = ?, released_at = ? WHERE id = ?", (RELEASED, _now(), reservation_id)
            )
            self._record(
                connection,
                caller,
                "release",
                row[1],
                dataset_id,
                {
                    "reservation_id": reservation_id,
                    "job_id": reservation.job_id,
                    "committed_steps": reservation.committed_steps,
                    "freed_steps": unrun.steps,
                },
            )
            row = self._reservation_row(connection, caller, reservation_id)
        return self._reservation(caller, row)

    def history(
        self, dataset: str | None = None, limit: int = 1000, *, caller: Caller | None = None
    ) -> list[HistoryEntry]:
        """The newest `limit` changes the caller may see (its tenant's; all for an admin), oldest first."""
        caller = self._caller(caller)
        limit = check_history_limit(limit)
        conditions, parameters = [], []
        with self._read() as connection:
            if dataset is not None:
                conditions.append("h.dataset_id = ?")
                parameters.append(self._dataset_row(connection, caller, dataset)[0])
            elif not caller.admin:
                conditions.append("h.tenant = ?")
                parameters.append(caller.tenant)
            where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
            rows = connection.execute(
                "SELECT h.id, h.at, h.actor, h.action, d.tenant, d.name, h.details FROM history h "
                f"LEFT JOIN datasets d ON d.id = h.dataset_id {where} ORDER BY h.id DESC LIMIT ?",
                (*parameters, limit),
            ).fetchall()
        return [
            HistoryEntry(
                entry_id=entry_id,
                at=at,
                actor=actor,
                action=action,
                dataset=display_name(caller, DatasetRef(tenant, name)) if name is not None else None,
                details=json.loads(details),
            )
            for entry_id, at, actor, action, tenant, name, details in reversed(rows)
        ]


def _local_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry, as in some containers
        return "unknown"


def open_embedded_ledger(path: str | os.PathLike | None = None) -> Ledger:
    """The single-machine ledger: the local user is admin and owns the tenant 'local'.

    `path` defaults to `default_ledger_path()`; its folder is created.
    """
    path = Path(path) if path is not None else default_ledger_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    caller = Caller(actor=f"{_local_user()} (embedded)", tenant=LOCAL_TENANT, admin=True)
    ledger = Ledger(path, caller=caller)
    ledger._ensure_tokenless_tenant(LOCAL_TENANT, caller)
    return ledger
