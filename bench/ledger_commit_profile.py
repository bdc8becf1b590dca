"""Where one commit's time goes on PostgreSQL: `python -m bench.ledger_commit_profile [--json]`.

The embedded ledger (no gRPC) on a throwaway PostgreSQL cluster on loopback
(bench/postgres.py), one client committing 1 step at a time to one long
reservation. Every statement the store sends is timed: printed are the
statements per commit, the time spent waiting on each kind, and the share of
a commit that is waiting on the database, against the Python time of the
rest. All of a change runs under one lock (and PostgreSQL's advisory lock),
so the time under it bounds what one database can commit a second however
many clients and servers there are; group commit shares only BEGIN, the
lock, and COMMIT between the changes of a batch.

`--json` also writes bench/results/ledger-commit-profile.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from pathlib import Path

from accounting.events import SampledGaussian
from accounting.ledger import databases
from accounting.ledger.callers import ADMIN
from accounting.ledger.store import Ledger
from bench.postgres import PostgresCluster, postgresql_binaries

RESULTS = Path(__file__).resolve().parent / "results" / "ledger-commit-profile.json"
# Shared by every change of a group-committed batch, not paid per change.
_PER_BATCH = ("BEGIN", "SELECT pg_advisory_xact_lock", "COMMIT")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ledger_commit_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=300, help="commits timed (default 300)")
    parser.add_argument("--json", action="store_true", help="also write bench/results/ledger-commit-profile.json")
    args = parser.parse_args(argv)
    binaries, where = postgresql_binaries()
    if binaries is None:
        print(f"no PostgreSQL to run: {where}")
        return 1
    load_before = os.getloadavg()
    counts, seconds = collections.Counter(), collections.Counter()
    original = databases._PostgresConnection.execute

    def timed(connection: object, statement: str, parameters: tuple | list = ()) -> object:
        started = time.perf_counter()
        try:
            return original(connection, statement, parameters)
        finally:
            kind = " ".join(statement.split())[:60]
            counts[kind] += 1
            seconds[kind] += time.perf_counter() - started

    cluster = PostgresCluster(binaries)
    cluster.start()
    databases._PostgresConnection.execute = timed
    try:
        with Ledger(cluster.create_database("profile"), caller=ADMIN) as ledger:
            ledger.create_tenant("acme")
            ledger.create_dataset("acme/mnist", 1e6, 1e-5)
            reservation_id = ledger.reserve("acme/mnist", "job", SampledGaussian(0.001, 1.0, 10**6)).reservation_id
            for sequence in range(20):  # connections open, curves cached
                ledger.commit(reservation_id, 1, sequence)
            counts.clear()
            seconds.clear()
            started = time.perf_counter()
            for sequence in range(20, 20 + args.commits):
                ledger.commit(reservation_id, 1, sequence)
            wall = time.perf_counter() - started
    finally:
        databases._PostgresConnection.execute = original
        cluster.stop()
    per_commit = args.commits
    statements = [
        {"statement": kind, "per_commit": counts[kind] / per_commit, "ms_per_commit": seconds[kind] / per_commit * 1e3,
         "per_batch": kind.startswith(_PER_BATCH)}
        for kind in sorted(counts, key=lambda kind: -seconds[kind])
    ]
    waiting_ms = sum(seconds.values()) / per_commit * 1e3
    per_change_ms = sum(row["ms_per_commit"] for row in statements if not row["per_batch"])
    commit_ms = wall / per_commit * 1e3
    print(f"{per_commit} commits, one client, embedded: {commit_ms:.2f} ms each; "
          f"{sum(counts.values()) / per_commit:.1f} statements each, {waiting_ms:.2f} ms waiting on them "
          f"({waiting_ms / commit_ms:.0%}), {commit_ms - waiting_ms:.2f} ms of Python")
    for row in statements:
        shared = " (once per batch)" if row["per_batch"] else ""
        print(f"  {row['per_commit']:4.1f} x {row['ms_per_commit']:6.3f} ms  {row['statement']}{shared}")
    ceiling = 1e3 / (per_change_ms + commit_ms - waiting_ms)
    print(f"under the lock per change, batch costs aside: {per_change_ms:.2f} ms waiting + "
          f"{commit_ms - waiting_ms:.2f} ms Python: at most {ceiling:.0f} commits/s on one database")
    if args.json:
        machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                   "load_average_before": load_before, "load_average_after": os.getloadavg()}
        RESULTS.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": machine,
            "command": "python -m bench.ledger_commit_profile " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit_ms": commit_ms, "waiting_ms": waiting_ms, "per_change_waiting_ms": per_change_ms,
            "ceiling_commits_per_second": ceiling, "statements": statements,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
