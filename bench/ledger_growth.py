"""How the embedded ledger's costs grow with its history: `python -m bench.ledger_growth [--json] [--points ...]`.

For each point (commits, distinct mechanisms) a fresh SQLite ledger gets
that many commits of 1 step on one dataset (δ 1e-5, q 0.004), from jobs
of up to 20 commits, job j with mechanism j mod M (each mechanism its own
σ, as jobs that calibrate σ to a target ε bring). Then it times, with the
history in place:

- `commit_seconds`: one commit of a running job (median of 100);
- `status_seconds`: a status waiting for the PLD figure just after a commit
  (median of 5; the dataset's composed PLD extended by that commit);
- `status_new_mechanism_seconds`: the same after the first commit of a σ never
  seen before (its one-step PLD is built: dp-accounting's Python loop);
- `reserve_new_mechanism_seconds`: a reserve of a σ never seen before (its RDP
  curve is computed; median of NEW_MECHANISM_RESERVES, each of its own σ), and `reserve_new_mechanism_goal_ratio` its ratio to the goal;
- `status_first_seconds`: the first status of the point, just after its history
  was committed: it waits for the composition the commits started in the
  background (store.composed) and composes what that has not reached;
- `status_after_restart_seconds`: a status of a ledger reopened in a process
  that forgot every figure, RDP curve, tally and distribution (the composed
  state and RDP tally the closing ledger kept are read back from the file;
  steps committed since, if any, are composed onto them), and
  `status_after_restart_goal_ratio` its ratio to the goal;
- `history_seconds`: the dataset's last 50 history entries (median of 20);
- `verify_first_seconds`: the first `verify` of the history, which replays every
  entry and keeps its state; `verify_seconds`: `verify` after 1,000 more
  commits (every hash checked, the entries since replayed from the kept
  state: `verify_replayed_entries` of `verify_entries`); `verify_full_seconds`:
  `verify --full`, replaying every entry (each also in CPU seconds of the process,
  `verify_cpu_seconds` and `verify_full_cpu_seconds`: on a shared machine the wall time
  mostly measures the other work);
- `database_bytes`: the file and its WAL.

Goals (on 2 cores): at 100k commits and 1,000 mechanisms commit
≤ 5 ms, status with PLD ≤ 0.5 s, history ≤ 5 ms; incremental verify of
1,000 new commits ≤ 2 s; the first status after a restart ≤ 1 s
(RESTART_GOAL_SECONDS) and a reserve of a new σ ≤ 5 ms
(NEW_MECHANISM_RESERVE_GOAL_SECONDS). `--json` writes bench/results/ledger-growth.json (or `--output`).
`--chain-entries N` only times verify's chain check over N entries built in memory; `--curves N` only
times N new mechanisms' RDP curves and one-step PLDs in CPU seconds, each beside dp-accounting's own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from accounting.events import Composition, SampledGaussian
from accounting.ledger.admission import forget_figures
from accounting.ledger.callers import ADMIN
from accounting.ledger.store import Ledger
from accounting.ledger.verification import StoredEntry, chain_findings, history_hash

RESULTS = Path(__file__).resolve().parent / "results" / "ledger-growth.json"
DEFAULT_POINTS = ("1000x10", "10000x10", "100000x10", "1000x1000", "10000x1000", "100000x1000")
DELTA = 1e-5
SAMPLING_RATE = 0.004
DATASET = "acme/growth"
MAX_COMMITS_PER_JOB = 20
RESTART_GOAL_SECONDS = 1.0
NEW_MECHANISM_RESERVE_GOAL_SECONDS = 0.005
NEW_MECHANISM_RESERVES = 5


def mechanism(index: int) -> SampledGaussian:
    """The `index`-th job mechanism: its own σ in [0.9, 1.5)."""
    return SampledGaussian(SAMPLING_RATE, 0.9 + 0.6 * ((index * 0.6180339887) % 1.0), 1)


def parse_point(text: str) -> tuple[int, int]:
    """'10000x1000' as (commits, mechanisms)."""
    try:
        commits, mechanisms = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a point is COMMITSxMECHANISMS, such as 10000x1000 (got {text!r})") from None
    if commits < 1 or not 1 <= mechanisms <= commits:
        raise argparse.ArgumentTypeError(f"a point needs 1 <= mechanisms <= commits (got {text!r})")
    return commits, mechanisms


class Jobs:
    """Jobs committing one step at a time on the bench's dataset, job j with mechanism j mod `mechanisms`."""

    def __init__(self, ledger: Ledger, mechanisms: int, commits_per_job: int) -> None:
        self.ledger = ledger
        self.mechanisms = mechanisms
        self.commits_per_job = commits_per_job
        self.started = 0

    def run(self, commits: int, mechanism_index: int | None = None) -> None:
        """Commit `commits` steps, job after job (a job with `mechanism_index`'s mechanism when given)."""
        while commits > 0:
            steps = min(commits, self.commits_per_job)
            index = self.started % self.mechanisms if mechanism_index is None else mechanism_index
            reservation = self.ledger.reserve(DATASET, f"job-{self.started}", mechanism(index).with_steps(steps))
            self.started += 1
            for sequence in range(steps):
                self.ledger.commit(reservation.reservation_id, 1, sequence)
            self.ledger.release(reservation.reservation_id)
            commits -= steps

    def timed_commits(self, count: int) -> list[float]:
        """The seconds of each of `count` commits of one running job (of a known mechanism)."""
        reservation = self.ledger.reserve(DATASET, f"job-{self.started}", mechanism(0).with_steps(count))
        self.started += 1
        seconds = []
        for sequence in range(count):
            started = time.perf_counter()
            self.ledger.commit(reservation.reservation_id, 1, sequence)
            seconds.append(time.perf_counter() - started)
        self.ledger.release(reservation.reservation_id)
        return seconds


def timed(call) -> float:
    """The seconds `call()` takes."""
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def measure_point(commits: int, mechanisms: int, folder: Path) -> dict:
    """Build a ledger of `commits` commits of `mechanisms` mechanisms in `folder` and time it (see module doc)."""
    path, key = folder / f"ledger-{commits}x{mechanisms}.db", folder / "ledger-history.key"
    commits_per_job = max(1, min(MAX_COMMITS_PER_JOB, commits // mechanisms))
    forget_figures()
    started = time.perf_counter()
    with Ledger(path, caller=ADMIN, history_key_file=key) as ledger:
        ledger.create_tenant("acme")
        ledger.create_dataset(DATASET, 1e4, DELTA)
        jobs = Jobs(ledger, mechanisms, commits_per_job)
        jobs.run(commits)
        build_seconds = time.perf_counter() - started
        status_first = timed(lambda: ledger.get_budget(DATASET))
        commit_seconds = jobs.timed_commits(100)
        status_seconds = []
        for _ in range(5):
            jobs.run(1, mechanism_index=0)
            status_seconds.append(timed(lambda: ledger.get_budget(DATASET)))
        jobs.run(1, mechanism_index=mechanisms + commits)  # a σ of no earlier job, of this point or another
        status_new_mechanism = timed(lambda: ledger.get_budget(DATASET))
        reserve_new_mechanism = []
        for index in range(NEW_MECHANISM_RESERVES):
            reservations = []
            reserve_new_mechanism.append(timed(lambda: reservations.append(ledger.reserve(
                DATASET, f"job-{jobs.started}", mechanism(mechanisms + commits + 1 + index).with_steps(1)))))
            jobs.started += 1
            ledger.release(reservations[0].reservation_id)
        reserve_new_mechanism = statistics.median(reserve_new_mechanism)
        history_seconds = [timed(lambda: ledger.history(DATASET, 50)) for _ in range(20)]
        verifications = []

        def verify(full: bool = False) -> None:
            verifications.append(ledger.verify(full=full))
            assert not verifications[-1].findings, verifications[-1].findings[:5]

        verify_first_seconds = timed(verify)  # no state kept yet: replays everything, and keeps its state
        jobs.run(1000)
        # CPU seconds too: on a shared machine the wall time mostly measures the other work.
        cpu_started = time.process_time()
        verify_seconds = timed(verify)
        verify_cpu_seconds, cpu_started = time.process_time() - cpu_started, time.process_time()
        verify_full_seconds = timed(lambda: verify(full=True))
        verify_full_cpu_seconds = time.process_time() - cpu_started
        replayed = [verification.replayed for verification in verifications]
    forget_figures()
    with Ledger(path, caller=ADMIN, history_key_file=key) as reopened:
        status_after_restart = timed(lambda: reopened.get_budget(DATASET))
    database_bytes = sum(
        candidate.stat().st_size for candidate in (path, Path(f"{path}-wal")) if candidate.exists()
    )
    return {
        "commits": commits,
        "mechanisms": mechanisms,
        "commits_per_job": commits_per_job,
        "build_seconds": build_seconds,
        "commit_seconds": statistics.median(commit_seconds),
        "commit_seconds_p99": sorted(commit_seconds)[98],
        "status_seconds": statistics.median(status_seconds),
        "status_seconds_max": max(status_seconds),
        "status_new_mechanism_seconds": status_new_mechanism,
        "reserve_new_mechanism_seconds": reserve_new_mechanism,
        "reserve_new_mechanism_goal_ratio": reserve_new_mechanism / NEW_MECHANISM_RESERVE_GOAL_SECONDS,
        "status_first_seconds": status_first,
        "status_after_restart_seconds": status_after_restart,
        "status_after_restart_goal_ratio": status_after_restart / RESTART_GOAL_SECONDS,
        "history_seconds": statistics.median(history_seconds),
        "verify_first_seconds": verify_first_seconds,
        "verify_seconds": verify_seconds,
        "verify_full_seconds": verify_full_seconds,
        "verify_cpu_seconds": verify_cpu_seconds,
        "verify_full_cpu_seconds": verify_full_cpu_seconds,
        "verify_entries": verifications[-1].entries,
        "verify_replayed_entries": replayed[1],
        "database_bytes": database_bytes,
    }


def measure_chain(entries: int) -> dict:
    """The seconds (wall and CPU) `verify`'s chain check takes over a history of `entries` commit entries (built in memory, each
    with the details a commit records), the part of every verify that reads the whole history."""
    key = os.urandom(32)
    details = json.dumps({"reservation_id": "r-0123456789abcdef", "job_id": "job-12345", "sequence": 7,
                          "events": Composition((mechanism(7),)).to_dict()}, sort_keys=True)
    history, previous = [], ""
    for entry_id in range(1, entries + 1):
        fields = (entry_id, "2026-11-26T09:00:00.000+00:00", "root (embedded)", "commit", "acme", 1, details)
        previous = history_hash(previous, *fields, key)
        history.append(StoredEntry(*fields, history[-1].entry_hash if history else "", previous))
    # CPU seconds too: on a shared machine the wall time mostly measures the other work.
    cpu_started = time.process_time()
    seconds = timed(lambda: chain_findings(history, {}, key))
    return {"chain_entries": entries, "chain_seconds": seconds, "chain_cpu_seconds": time.process_time() - cpu_started}


def measure_curves(count: int) -> dict:
    """CPU seconds of `count` new mechanisms' RDP curves and one-step PLDs (the bench's σ), each beside dp-accounting's
    own computation of the same, in one process."""
    import dp_accounting
    from dp_accounting.pld import privacy_loss_distribution

    from accounting.accountants import RDP_ORDERS, one_step_pld, sampled_gaussian_rdp

    seconds = {"curve": 0.0, "curve_dp_accounting": 0.0, "one_step_pld": 0.0, "one_step_pld_dp_accounting": 0.0}
    for index in range(count):
        sigma = mechanism(10**6 + index).noise_multiplier  # a σ of no earlier point: nothing cached
        for name, compute in (
            ("curve", lambda: sampled_gaussian_rdp(SAMPLING_RATE, sigma)),
            ("curve_dp_accounting", lambda: dp_accounting.rdp.RdpAccountant(orders=RDP_ORDERS).compose(
                dp_accounting.PoissonSampledDpEvent(SAMPLING_RATE, dp_accounting.GaussianDpEvent(sigma)))),
            ("one_step_pld", lambda: one_step_pld(SAMPLING_RATE, sigma, 1e-4)),
            ("one_step_pld_dp_accounting", lambda: privacy_loss_distribution.from_gaussian_mechanism(
                standard_deviation=sigma, value_discretization_interval=1e-4, sampling_prob=SAMPLING_RATE)),
        ):
            started = time.process_time()
            compute()
            seconds[name] += time.process_time() - started
    return {"mechanisms": count, **{f"{name}_cpu_seconds": total / count for name, total in seconds.items()},
            "curve_ratio": seconds["curve_dp_accounting"] / seconds["curve"],
            "one_step_pld_ratio": seconds["one_step_pld_dp_accounting"] / seconds["one_step_pld"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ledger_growth", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--points", nargs="+", type=parse_point, default=[parse_point(point) for point in DEFAULT_POINTS[:1]],
        metavar="COMMITSxMECHANISMS",
        help=f"the points to measure (default {DEFAULT_POINTS[0]}; the full set is {' '.join(DEFAULT_POINTS)})",
    )
    parser.add_argument(
        "--chain-entries", type=int, metavar="N",
        help="only time verify's chain check over N history entries built in memory (printed, not written)",
    )
    parser.add_argument(
        "--curves", type=int, metavar="N",
        help="only time N new mechanisms' RDP curves and one-step PLDs beside dp-accounting's (printed, not written)",
    )
    parser.add_argument("--json", action="store_true", help="also write the results as JSON (see --output)")
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help="where --json writes (default bench/results/ledger-growth.json)"
    )
    args = parser.parse_args(argv)
    if args.curves is not None:
        print(json.dumps({**measure_curves(args.curves), "load_average": os.getloadavg()}))
        return 0
    if args.chain_entries is not None:
        print(json.dumps({**measure_chain(args.chain_entries), "load_average": os.getloadavg()}))
        return 0
    load_before = os.getloadavg()
    command = "python -m bench.ledger_growth " + " ".join(argv if argv is not None else sys.argv[1:])
    results = []
    with tempfile.TemporaryDirectory(prefix="dpfleet-ledger-growth-") as folder:
        for commits, mechanisms in args.points:
            result = measure_point(commits, mechanisms, Path(folder))
            results.append(result)
            print(json.dumps(result), flush=True)
            print(f"{commits}x{mechanisms}: first status after a restart {result['status_after_restart_seconds']:.3f} s "
                  f"({result['status_after_restart_goal_ratio']:.2f}x the {RESTART_GOAL_SECONDS:g} s goal), reserve of "
                  f"a new σ {1e3 * result['reserve_new_mechanism_seconds']:.2f} ms "
                  f"({result['reserve_new_mechanism_goal_ratio']:.2f}x the "
                  f"{1e3 * NEW_MECHANISM_RESERVE_GOAL_SECONDS:g} ms goal), load {os.getloadavg()[0]:.2f}", flush=True)
            if args.json:  # after each point: a long run stopped early keeps the points it measured
                machine = {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform(), "sqlite": sqlite3.sqlite_version,
                           "load_average_before": load_before, "load_average_after": os.getloadavg()}
                args.output.write_text(json.dumps(
                    {"date": time.strftime("%Y-%m-%d"), "machine": machine, "command": command, "points": results},
                    indent=2,
                ) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
