"""Where a ledger keeps its state: an SQLite file (the default) or a PostgreSQL database.

Both are used through the same SQL: `?` placeholders, ON CONFLICT DO
NOTHING, RETURNING. A `Database` says what differs: how to connect, how a
change's transaction begins, the schema's types and triggers, and which
errors mean the database did not answer.

Serialising changes. On SQLite, BEGIN IMMEDIATE takes the file's write lock,
which every process sharing the file waits for. On PostgreSQL, every change
begins by taking one transaction-scoped advisory lock (pg_advisory_xact_lock)
in READ COMMITTED: every change appends to one hash chain, whose next entry
depends on the last, so changes are serial by construction, and holding the
lock from a transaction's first statement makes each later statement see
every change committed before it, whichever server made it. Admission thus
runs on the latest state, as if the servers took turns. SERIALIZABLE would
also be correct, but with one chain every pair of concurrent changes
conflicts on its head, so it would abort and retry nearly all of them; the
lock queues them instead. Reads run in REPEATABLE READ READ ONLY, one
snapshot per read.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol
from urllib.parse import urlsplit

from accounting.ledger.errors import FailedPrecondition

POSTGRESQL_SCHEMES = ("postgresql", "postgres")
# The advisory lock every change takes on PostgreSQL: "dpfl" in ASCII, one number for the whole database.
_CHANGE_LOCK = 0x6470666C


class Connection(Protocol):
    """What the store uses of a connection: sqlite3's, or `_PostgresConnection`."""

    def execute(self, statement: str, parameters: tuple | list = ()) -> Any:
        """Run one statement with `?` placeholders; returns a cursor (fetchone, fetchall, rowcount)."""

    def close(self) -> None:
        """Close the connection."""


@dataclass(frozen=True)
class Database:
    """One kind of store: how to reach it and the few pieces of SQL that differ between kinds."""

    location: str
    connect: Callable[[], object]
    begin_change: tuple[str, ...]
    begin_read: str
    schema_exists: str
    types: dict
    append_only: tuple[str, ...]
    drop_append_only: tuple[str, ...]
    insertion_order: str
    duplicate_errors: tuple[type[BaseException], ...]
    unavailable_errors: tuple[type[BaseException], ...]
    is_file: bool


def is_postgresql(location: str | Path) -> bool:
    """True when `location` is a postgresql:// (or postgres://) URL rather than a file."""
    return isinstance(location, str) and urlsplit(location).scheme in POSTGRESQL_SCHEMES


def shown_location(location: str) -> str:
    """A URL without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", location)


def _sqlite_connection(path: Path) -> sqlite3.Connection:
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


class _PostgresConnection:
    """A psycopg connection in autocommit mode (transactions are begun explicitly), taking `?` placeholders."""

    def __init__(self, url: str) -> None:
        import psycopg

        self._connection = psycopg.connect(url, autocommit=True, connect_timeout=10)
        self._idle = psycopg.pq.TransactionStatus.IDLE

    def execute(self, statement: str, parameters: tuple | list = ()) -> object:
        """Run one statement; `?` marks each parameter, as with sqlite3."""
        return self._connection.execute(statement.replace("?", "%s"), parameters or None)

    @property
    def in_transaction(self) -> bool:
        """True between BEGIN and COMMIT or ROLLBACK."""
        return self._connection.info.transaction_status != self._idle

    def close(self) -> None:
        """Close the connection."""
        self._connection.close()


def open_database(location: str | Path) -> Database:
    """The store at `location`: a postgresql:// URL, else the path of an SQLite file."""
    if not is_postgresql(location):
        path = Path(location)
        return Database(
            location=str(path),
            connect=lambda: _sqlite_connection(path),
            begin_change=("BEGIN IMMEDIATE",),
            begin_read="BEGIN",
            schema_exists="SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'",
            types={
                "integer": "INTEGER",
                "float": "REAL",
                "bytes": "BLOB",
                "dataset_id": "INTEGER PRIMARY KEY",
                "history_id": "INTEGER PRIMARY KEY AUTOINCREMENT",
                "order_column": "",
                # An SQLite index holds the rowid after its columns: the insertion order needs no column.
                "order_key": "",
            },
            append_only=(
                """CREATE TRIGGER history_is_append_only_update BEFORE UPDATE ON history
                    BEGIN SELECT RAISE(ABORT, 'the ledger history is append-only'); END""",
                """CREATE TRIGGER history_is_append_only_delete BEFORE DELETE ON history
                    BEGIN SELECT RAISE(ABORT, 'the ledger history is append-only'); END""",
            ),
            # SQLite has no TRUNCATE; a DELETE without WHERE runs the delete trigger like any other.
            drop_append_only=(
                "DROP TRIGGER IF EXISTS history_is_append_only_update",
                "DROP TRIGGER IF EXISTS history_is_append_only_delete",
            ),
            insertion_order="rowid",
            duplicate_errors=(sqlite3.IntegrityError,),
            unavailable_errors=(),
            is_file=True,
        )
    try:
        import psycopg
    except ImportError:
        raise FailedPrecondition(
            "a PostgreSQL ledger needs psycopg 3; install it with: pip install 'dpfleet[postgresql]'"
        ) from None
    url = str(location)
    return Database(
        location=shown_location(url),
        connect=lambda: _PostgresConnection(url),
        begin_change=("BEGIN", f"SELECT pg_advisory_xact_lock({_CHANGE_LOCK})"),
        begin_read="BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
        schema_exists="SELECT 1 WHERE to_regclass('schema_version') IS NOT NULL",
        types={
            "integer": "BIGINT",
            "float": "DOUBLE PRECISION",
            "bytes": "BYTEA",
            "dataset_id": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
            "history_id": "BIGINT PRIMARY KEY",
            "order_column": ",\n        seq BIGINT GENERATED ALWAYS AS IDENTITY",
            "order_key": ", seq",
        },
        append_only=(
            """CREATE FUNCTION history_is_append_only() RETURNS trigger LANGUAGE plpgsql AS
                $$ BEGIN RAISE EXCEPTION 'the ledger history is append-only'; END $$""",
            """CREATE TRIGGER history_is_append_only BEFORE UPDATE OR DELETE ON history
                FOR EACH ROW EXECUTE FUNCTION history_is_append_only()""",
            # TRUNCATE fires no row trigger: it needs a statement trigger of its own.
            """CREATE TRIGGER history_is_append_only_truncate BEFORE TRUNCATE ON history
                FOR EACH STATEMENT EXECUTE FUNCTION history_is_append_only()""",
        ),
        drop_append_only=(
            "DROP TRIGGER IF EXISTS history_is_append_only ON history",
            "DROP TRIGGER IF EXISTS history_is_append_only_truncate ON history",
            "DROP FUNCTION IF EXISTS history_is_append_only()",
        ),
        insertion_order="seq",
        duplicate_errors=(psycopg.errors.UniqueViolation,),
        unavailable_errors=(psycopg.OperationalError, psycopg.InterfaceError),
        is_file=False,
    )
