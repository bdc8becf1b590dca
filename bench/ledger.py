"""Ledger throughput and latency on loopback: `python -m bench.ledger [--json]`.

A ledger server runs in its own process on a fresh file (WAL, synchronous=FULL).
Client processes (1, then 8) each run one workload for a fixed time:

- commit: commits of 1 step on the client's own long reservation; every
  commit is durable (fsync'd) before its reply.
- reserve+commit: reserve a 10-step job, then commit its 10 steps; the
  throughput counts pairs, the latency each RPC.
- status: GetBudget of a dataset with 10,000 finished jobs in its history
  (prepared beforehand through the embedded ledger).
- status after commit (1 client, last): commit a step to that dataset, then
  time its GetBudget, which computes the PLD epsilon of the changed
  committed events (later statuses read it from a cache).
- status after commit, no wait (1 client): the same with
  pld_may_be_pending: the server answers at once with the RDP epsilon
  while it computes the PLD epsilon in the background.
- no-op floor: the gRPC health check of the same server, which does no
  ledger work: what the transport, Python's gRPC and this machine cost alone.

Each runs closed loop (every client sends its next request when the last
reply arrives: the most load the clients can make, so latency there is
mostly queueing), and the commit workloads and the no-op floor also run
open loop: each client sends at the arrivals of its own Poisson process, at
a fixed total rate, and latency is counted from each request's scheduled
start. A disk floor (durable one-row SQLite transactions, no ledger, no
gRPC) measures the file system's own tail in the same run.

Targets: >= 1,000 durable commits/s, p99 < 10 ms per RPC, status < 20 ms at
10,000 jobs. `--json` also writes bench/results/ledger.json.

`--db postgresql` runs the same workloads against a throwaway PostgreSQL
cluster on loopback (bench/postgres.py; fsync and synchronous_commit on, the
defaults) instead of an SQLite file, and writes ledger-postgresql.json.
`--servers 3` starts three servers on that one database and spreads the 8
clients of the two write workloads across them (ledger-postgresql-3-servers.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from accounting.events import SampledGaussian
from accounting.ledger.callers import ADMIN
from accounting.ledger.client import RemoteLedger
from accounting.ledger.store import Ledger, default_history_key_path
from bench.postgres import PostgresCluster, postgresql_binaries

ADMIN_TOKEN = "bench-admin-token-0123456789abcdef"
DELTA = 1e-5
STEP = SampledGaussian(0.001, 1.0, 1)
HISTORY_JOBS = 10_000
# A long reservation: more steps than any run commits, within the datasets' budget of 1e4 (8 at once).
LONG_JOB_STEPS = 10**7
TARGET_COMMITS_PER_SECOND = 1000.0
TARGET_P99_MS = 10.0
TARGET_STATUS_MS = 20.0
WORKLOADS = ("commit", "reserve+commit", "status", "no-op floor")
# Open-loop runs with 8 clients: (workload, operations per second in all).
PACED = (("commit", 500.0), ("commit", 1000.0), ("reserve+commit", 100.0), ("no-op floor", 500.0))
RESULTS = Path(__file__).resolve().parent / "results" / "ledger.json"
_SERVE = (
    "import json, sys\n"
    "from accounting.ledger.service import serve\n"
    "serve(sys.argv[1], '127.0.0.1', 0, sys.argv[2], announce=lambda server: print(server.address, flush=True),\n"
    "      **json.loads(sys.argv[3]))\n"
)


def serve_process(db: str | Path, rate_limits: dict | None = None) -> subprocess.Popen:
    """A ledger server in a process of its own on `db`, with ADMIN_TOKEN; its first line of output is its address.

    `rate_limits` are start_server's, by name (None: the defaults). Every server of the benchmark reads this
    machine's default history key, named, since a ledger on PostgreSQL needs its key named.
    """
    key = {"history_key_file": str(default_history_key_path()), "allow_key_beside_database": True}
    return subprocess.Popen(
        [sys.executable, "-c", _SERVE, str(db), ADMIN_TOKEN, json.dumps({**key, **(rate_limits or {})})],
        stdout=subprocess.PIPE, text=True,
    )


def timed(call: Callable[[], object]) -> list[float]:
    """The seconds `call` took, as a one-RPC operation's latencies."""
    began = time.perf_counter()
    call()
    return [time.perf_counter() - began]


def closed_loop(operation: Callable[[int], list[float]], seconds: float, first: int = 1) -> tuple[int, list[float]]:
    """Call `operation` with first, first + 1, ..., each as soon as the last returns, for `seconds`.

    Returns how many operations ran and the latencies they returned. The
    most load one client makes: latency under it is mostly queueing.
    """
    latencies: list[float] = []
    count, deadline = first, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        latencies += operation(count)
        count += 1
    return count - first, latencies


def prepare_history(db: str | Path, jobs: int) -> str:
    """Fill a ledger (file or URL) with a tenant and a dataset of `jobs` finished jobs; return the tenant's token."""
    with Ledger(db, caller=ADMIN) as ledger:
        token = ledger.create_tenant("bench").token
        ledger.create_dataset("bench/history", 1e4, DELTA)
        ledger.create_dataset("bench/writes", 1e4, DELTA)

        def finished_job(index: int) -> None:
            reservation = ledger.reserve("bench/history", f"finished-{index}", STEP.with_steps(10))
            ledger.commit(reservation.reservation_id, 10, 0)
            ledger.release(reservation.reservation_id)

        # Threads let the ledger group their commits, as it does for concurrent RPCs.
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(finished_job, range(jobs)))
    return token


def disk_floor(folder: Path, seconds: float = 10.0) -> dict:
    """Durable one-row SQLite transactions (WAL, synchronous=FULL) beside the ledger file for `seconds`: the disk's share.

    One thread, one transaction at a time, SQLite's default checkpoints: no
    ledger and no gRPC. Reports p50/p99/max and how many took over 10 ms,
    the stalls that any durable commit landing on them waits out.
    """
    connection = sqlite3.connect(folder / "floor.db", isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute("CREATE TABLE rows (value INTEGER)")
    latencies = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("INSERT INTO rows VALUES (?)", (len(latencies),))
        connection.execute("COMMIT")
        latencies.append(time.perf_counter() - began)
    connection.close()
    latencies_ms = np.array(latencies) * 1000.0
    return {"transactions": len(latencies), "seconds": seconds,
            "p50_ms": float(np.percentile(latencies_ms, 50)), "p99_ms": float(np.percentile(latencies_ms, 99)),
            "max_ms": float(latencies_ms.max()), "over_target_p99": int((latencies_ms > TARGET_P99_MS).sum())}


def _operation(ledger: RemoteLedger, workload: str, index: int, health) -> Callable[[int], list[float]]:
    """The workload's operation for this client: called with a counter, it returns the latency of each RPC."""
    if workload == "commit":
        long_job = f"long-{index}-{os.getpid()}"
        reservation_id = ledger.reserve("writes", long_job, STEP.with_steps(LONG_JOB_STEPS)).reservation_id
        return lambda count: timed(lambda: ledger.commit(reservation_id, 1, count))
    if workload == "reserve+commit":

        def pair(count: int) -> list[float]:
            began = time.perf_counter()
            reservation = ledger.reserve("writes", f"job-{index}-{os.getpid()}-{count}", STEP.with_steps(10))
            middle = time.perf_counter()
            ledger.commit(reservation.reservation_id, 10, 0)
            return [middle - began, time.perf_counter() - middle]

        return pair
    if workload == "status":
        return lambda count: timed(lambda: ledger.get_budget("history"))
    if workload.startswith("status after commit"):
        long_job = f"long-{index}-{os.getpid()}"
        reservation_id = ledger.reserve("history", long_job, STEP.with_steps(LONG_JOB_STEPS)).reservation_id
        pld_may_be_pending = workload.endswith("no wait")

        def commit_then_status(count: int) -> list[float]:
            ledger.commit(reservation_id, 1, count)
            return timed(lambda: ledger.get_budget("history", pld_may_be_pending))

        return commit_then_status
    request = health_pb2.HealthCheckRequest(service="")
    return lambda count: timed(lambda: health.Check(request, timeout=30))


def _client(
    addresses: list[str], token: str, workload: str, seconds: float, rate: float | None, index: int, barrier,
    results,
) -> None:
    """One client process: warm up, wait for the others, run the workload, report latencies.

    With `rate` (operations per second for this client) operations start at
    the arrivals of a Poisson process of that rate, independent of the other
    clients' (open loop), and each latency is counted from its scheduled
    start, so time spent queueing behind a slow reply is not hidden; without
    it, each operation starts when the previous one returns (closed loop).
    """
    arrivals = np.random.default_rng()
    address = addresses[index % len(addresses)]
    with RemoteLedger(address, token, timeout_seconds=30) as ledger, grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        operation = _operation(ledger, workload, index, health)
        ledger.get_budget("history")
        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        latencies: list[float] = []
        operations = 0
        barrier.wait()
        start = time.perf_counter()
        deadline = start + seconds
        if rate is None:
            operations, latencies = closed_loop(operation, seconds)
        else:
            scheduled = start + arrivals.exponential(1.0 / rate)
            while scheduled < deadline:
                operations += 1
                time.sleep(max(0.0, scheduled - time.perf_counter()))
                waited = time.perf_counter() - scheduled
                took = operation(operations)
                latencies += [waited + took[0], *took[1:]]
                scheduled += arrivals.exponential(1.0 / rate)
        results.put((operations, time.perf_counter() - start, latencies))


def run_workload(addresses: list[str], token: str, workload: str, clients: int, seconds: float,
                 total_rate: float | None = None) -> dict:
    """Run `clients` processes of one workload at once; return throughput and latency figures.

    Client i talks to addresses[i % len(addresses)]. `total_rate` paces them
    (open loop) at that many operations per second in all.
    """
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(clients)
    results = context.Queue()
    rate = None if total_rate is None else total_rate / clients
    processes = [
        context.Process(target=_client, args=(addresses, token, workload, seconds, rate, index, barrier, results))
        for index in range(clients)
    ]
    for process in processes:
        process.start()
    reports = [results.get(timeout=seconds + 120) for _ in processes]
    for process in processes:
        process.join()
    operations = sum(report[0] for report in reports)
    elapsed = max(report[1] for report in reports)
    latencies_ms = np.array([latency for report in reports for latency in report[2]]) * 1000.0
    return {
        "workload": workload,
        "clients": clients,
        "offered_per_second": total_rate,
        "operations": operations,
        "seconds": elapsed,
        "per_second": operations / elapsed,
        "p50_ms": float(np.percentile(latencies_ms, 50)),
        "p99_ms": float(np.percentile(latencies_ms, 99)),
    }


def _ratios(rows: list[dict]) -> dict:
    """Each target over the measured figure (commits: figure over target); 1 or more means met.

    Also the ledger's closed-loop p99 over the no-op floor's, at the same number of clients.
    """

    def p99(clients: int, workload: str, offered: float | None = None) -> float:
        return next(row["p99_ms"] for row in rows if (row["clients"], row["workload"], row["offered_per_second"])
                    == (clients, workload, offered))

    def worst_ledger_p99(clients: int) -> float:
        return max(p99(clients, workload) for workload in WORKLOADS[:3])

    best_commits = max(row["per_second"] for row in rows if row["workload"] == "commit")
    ratios = {
        "durable commits/s (best) / 1000": best_commits / TARGET_COMMITS_PER_SECOND,
        "10 ms / worst p99, 1 client": TARGET_P99_MS / worst_ledger_p99(1),
        "10 ms / worst p99, 8 clients, closed loop": TARGET_P99_MS / worst_ledger_p99(8),
    }
    for workload, offered in PACED:
        floor = " (not a target)" if workload == "no-op floor" else ""
        ratios[f"10 ms / {workload} p99, 8 clients paced at {offered:.0f}/s{floor}"] = (
            TARGET_P99_MS / p99(8, workload, offered))
    ratios["20 ms / status p99 at 10k jobs, 1 client"] = TARGET_STATUS_MS / p99(1, "status")
    ratios["20 ms / status p99 at 10k jobs, 8 clients"] = TARGET_STATUS_MS / p99(8, "status")
    ratios["20 ms / status p99 at 10k jobs after a commit, waiting for PLD, 1 client"] = (
        TARGET_STATUS_MS / p99(1, "status after commit"))
    ratios["20 ms / status p99 at 10k jobs after a commit, RDP while PLD computes, 1 client"] = (
        TARGET_STATUS_MS / p99(1, "status after commit, no wait"))
    for clients in (1, 8):
        ratios[f"worst ledger p99 / no-op floor p99, {clients} clients (not a target)"] = (
            worst_ledger_p99(clients) / p99(clients, "no-op floor"))
    return ratios


def _table(rows: list[dict]) -> str:
    lines = [f"{'workload':<28} {'clients':>7} {'offered/s':>9} {'ops':>8} {'ops/s':>9} {'p50 ms':>8} {'p99 ms':>8}"]
    for row in rows:
        offered = "closed" if row["offered_per_second"] is None else f"{row['offered_per_second']:.0f}"
        lines.append(
            f"{row['workload']:<28} {row['clients']:>7} {offered:>9} {row['operations']:>8} "
            f"{row['per_second']:>9.0f} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def ledger_database(kind: str, folder: Path) -> Iterator[str]:
    """An empty ledger store: an SQLite file in `folder`, or a database of a throwaway PostgreSQL cluster."""
    if kind == "sqlite":
        yield str(folder / "ledger.db")
        return
    binaries, where = postgresql_binaries()
    if binaries is None:
        raise SystemExit(f"--db postgresql: {where}")
    cluster = PostgresCluster(binaries)
    try:
        cluster.start()
        yield cluster.create_database("bench")
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    """Run every workload with 1 and 8 clients, print the table and the ratios to the targets.

    With more than one server, only the two write workloads run, with 8 clients spread across the servers.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each measurement (default 5)")
    parser.add_argument("--history-jobs", type=int, default=HISTORY_JOBS, help="finished jobs in the status dataset")
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite", help="the store (default sqlite)")
    parser.add_argument("--servers", type=int, default=1, help="ledger servers on the one store (default 1)")
    parser.add_argument("--json", action="store_true", help="also write bench/results/ledger*.json")
    args = parser.parse_args(argv)
    if args.servers > 1 and args.db != "postgresql":
        parser.error("--servers above 1 needs --db postgresql: servers share a database, not a file")
    load_before = os.getloadavg()  # other work on the machine skews every figure; recorded with them
    with tempfile.TemporaryDirectory(prefix="dpfleet-bench-") as folder, \
            ledger_database(args.db, Path(folder)) as db:
        began = time.perf_counter()
        token = prepare_history(db, args.history_jobs)
        print(f"prepared {args.history_jobs} finished jobs in {time.perf_counter() - began:.1f} s", flush=True)
        servers = [serve_process(db) for _ in range(args.servers)]
        try:
            addresses = [server.stdout.readline().strip() for server in servers]
            if args.servers == 1:
                runs = [(workload, clients, None) for workload in WORKLOADS for clients in (1, 8)]
                runs += [(workload, 8, offered) for workload, offered in PACED]
                # Last: they change the status dataset.
                runs += [("status after commit", 1, None), ("status after commit, no wait", 1, None)]
            else:
                runs = [("commit", 8, None), ("reserve+commit", 8, None)]
            rows = []
            for workload, clients, offered in runs:
                rows.append(run_workload(addresses, token, workload, clients, args.seconds, offered))
                print(_table(rows[-1:]).splitlines()[1], flush=True)
            disk = disk_floor(Path(folder))
        finally:
            for server in servers:
                server.terminate()
                server.wait(timeout=30)
    ratios = _ratios(rows) if args.servers == 1 else {}
    print()
    print(_table(rows))
    print(f"disk floor: {disk['transactions']} one-row durable SQLite transactions in {disk['seconds']:.0f} s, "
          f"1 thread: p50 {disk['p50_ms']:.2f} ms, p99 {disk['p99_ms']:.2f} ms, max {disk['max_ms']:.1f} ms, "
          f"{disk['over_target_p99']} over {TARGET_P99_MS:.0f} ms")
    print()
    for name, ratio in ratios.items():
        missed = ratio < 1 and "not a target" not in name
        print(f"{name}: {ratio:.2f}{'  (target missed)' if missed else ''}")
    if args.json:
        name = "ledger" if args.db == "sqlite" else f"ledger-{args.db}"
        results = RESULTS.parent / f"{name}{f'-{args.servers}-servers' if args.servers > 1 else ''}.json"
        results.parent.mkdir(parents=True, exist_ok=True)
        machine = {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "platform": platform.platform(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        }
        targets = {
            "commits_per_second": TARGET_COMMITS_PER_SECOND,
            "p99_ms": TARGET_P99_MS,
            "status_ms": TARGET_STATUS_MS,
        }
        results.write_text(
            json.dumps({"machine": machine, "date": time.strftime("%Y-%m-%d"), "db": args.db,
                        "servers": args.servers, "history_jobs": args.history_jobs, "seconds": args.seconds,
                        "targets": targets, "results": rows, "disk_floor": disk, "ratios": ratios}, indent=2) + "\n"
        )
        print(f"wrote {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
