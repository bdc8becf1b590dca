"""What the ledger's listings ask of the database, and whether each is served by an index.

`recording_statements` makes every Ledger opened afterwards record the
statements it runs; `listing_statements` runs the listings of the CLI and
the page (a dataset's last history entries, its jobs, its status, its
queue) on a ledger with some history and returns what they ran. A plan that
scans a table which grows with the history, or sorts its rows, means a
listing whose time grows with the whole history.
"""

import dataclasses
import re

from accounting.events import SampledGaussian
from accounting.ledger.callers import ADMIN, tenant_caller
from accounting.ledger.store import ledger as ledger_module

# The tables that grow with every job and commit; the others grow with tenants and datasets.
GROWING_TABLES = ("history", "reservations", "commits", "queued_jobs")
DELTA = 1e-5
STEP = SampledGaussian(0.004, 1.1, 1)


class _RecordingConnection:
    """A connection that appends each statement it runs, with its parameters, to `statements`."""

    def __init__(self, connection, statements):
        self._connection = connection
        self._statements = statements

    def execute(self, statement, parameters=()):
        self._statements.append((statement, tuple(parameters)))
        return self._connection.execute(statement, parameters)

    def __getattr__(self, name):
        return getattr(self._connection, name)


def recording_statements(monkeypatch):
    """Every statement of the Ledgers opened from now on, as (statement, parameters), in a list kept up to date."""
    statements = []
    real_open = ledger_module.open_database

    def recording_open(location):
        database = real_open(location)
        return dataclasses.replace(
            database, connect=lambda: _RecordingConnection(database.connect(), statements)
        )

    monkeypatch.setattr(ledger_module, "open_database", recording_open)
    return statements


def listing_statements(ledger, statements):
    """The reads (SELECT) that the listings ran on `ledger`, a ledger opened while recording, after some jobs."""
    ledger.create_tenant("team")
    team = tenant_caller("team")
    ledger.create_dataset("team/mnist", 5.0, DELTA)
    for job in range(3):
        reservation = ledger.reserve("team/mnist", f"job-{job}", STEP.with_steps(10))
        ledger.commit(reservation.reservation_id, 4, 0)
        if job < 2:
            ledger.release(reservation.reservation_id)
    del statements[:]
    ledger.history("team/mnist", 50)
    ledger.history("mnist", 50, caller=team)
    ledger.history(None, 50, caller=team)
    ledger.list_jobs("team/mnist")
    ledger.list_jobs("team/mnist", "active")
    ledger.list_jobs("team/mnist", charges=True)
    ledger.get_budget("team/mnist", caller=ADMIN)
    ledger.get_budget("mnist", caller=team)
    ledger.list_queued("team/mnist")
    return [(statement, parameters) for statement, parameters in statements
            if statement.lstrip().upper().startswith("SELECT")]


def reads_growing_table(statement):
    """True when `statement` reads one of GROWING_TABLES."""
    return any(re.search(rf"\b(FROM|JOIN)\s+{table}\b", statement) for table in GROWING_TABLES)


def sqlite_plan_problems(connection, statement, parameters):
    """What is wrong with an SQLite query plan: a growing table scanned, or rows sorted in a temporary B-tree."""
    plan = [detail for *_, detail in connection.execute(f"EXPLAIN QUERY PLAN {statement}", parameters)]
    aliases = set(GROWING_TABLES) | {
        alias for table, alias in re.findall(r"\b(?:FROM|JOIN)\s+(\w+)\s+(\w+)", statement) if table in GROWING_TABLES
    }
    return [detail for detail in plan
            if "TEMP B-TREE" in detail or any(re.fullmatch(rf"SCAN {alias}\b.*", detail) for alias in aliases)]


def postgres_plan_problems(connection, statement, parameters):
    """What is wrong with a PostgreSQL plan with sequential scans and sorts priced out: a growing table still
    read sequentially, or rows still sorted."""
    plan = [line for (line,) in connection.execute(
        f"EXPLAIN {statement.replace('?', '%s')}", parameters or None
    ).fetchall()]
    return [line.strip() for line in plan
            if re.search(r"Sort\b", line) or any(f"Seq Scan on {table}" in line for table in GROWING_TABLES)]
