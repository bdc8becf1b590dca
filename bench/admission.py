"""What the ledger's proven admission rule costs: `python -m bench.admission [--json]`.

The seed configuration (MNIST's main job: q = 250/60000, sigma 1.3, 3600
steps) is reserved and committed on a fresh embedded ledger again and again
until the ledger refuses it, for dataset budgets of epsilon 1, 3 and 10 at
delta 1e-5. Beside that count, for the same budgets:

- the grid rule: a job admitted while the RDP epsilon of everything held, at
  the best of all 173 orders of the grid at delta, fits the budget (with the
  same safety margin). Not proven when jobs are chosen adaptively;
- non-adaptive PLD: how many runs fit by the PLD epsilon of their
  composition, the tightest figure for runs fixed in advance, and no rule
  at all when they are not.

`--json` also writes bench/results/admission.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from accounting.accountants import get_accountant
from accounting.events import SampledGaussian
from accounting.ledger.admission import RdpTally, fits_budget
from accounting.ledger.errors import BudgetExceeded
from accounting.ledger.store import open_embedded_ledger

SEED_JOB = SampledGaussian(250 / 60000, 1.3, 3600)
DELTA = 1e-5
BUDGETS = (1.0, 3.0, 10.0)
RESULTS = Path(__file__).resolve().parent / "results" / "admission.json"


def admitted_by_the_ledger(budget_epsilon: float) -> tuple[int, dict]:
    """Reserve and commit the seed job on a fresh ledger until refused; the count and the dataset's rule."""
    with tempfile.TemporaryDirectory(prefix="dpfleet-admission-") as folder:
        with open_embedded_ledger(Path(folder) / "ledger.db") as ledger:
            rule = ledger.create_dataset("seed", budget_epsilon, DELTA).admission
            runs = 0
            while True:
                try:
                    reservation = ledger.reserve("seed", f"run-{runs}", SEED_JOB)
                except BudgetExceeded:
                    return runs, rule.to_dict()
                ledger.commit(reservation.reservation_id, SEED_JOB.steps, 0)
                runs += 1


def most_runs(fits: Callable[[int], bool]) -> int:
    """The largest n with fits(n), for fits that holds up to some n and never after (doubling, then bisection)."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def repeated(runs: int) -> SampledGaussian:
    """`runs` seed runs one after another: the same mechanism, their steps added."""
    return SEED_JOB.with_steps(runs * SEED_JOB.steps)


def main(argv: list[str] | None = None) -> int:
    """Count the seed runs each rule admits per budget; print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="also write bench/results/admission.json")
    args = parser.parse_args(argv)
    pld = get_accountant("pld")
    rows = []
    for budget_epsilon in BUDGETS:
        began = time.perf_counter()
        filter_runs, rule = admitted_by_the_ledger(budget_epsilon)
        grid_runs = most_runs(
            lambda runs: fits_budget(RdpTally.of(repeated(runs)).epsilon(DELTA), budget_epsilon)
        )
        pld_runs = most_runs(lambda runs: pld.epsilon(repeated(runs), DELTA) < budget_epsilon)
        rows.append({"budget_epsilon": budget_epsilon, "delta": DELTA, "filter_runs": filter_runs,
                     "grid_rule_runs": grid_runs, "non_adaptive_pld_runs": pld_runs, "filter": rule,
                     "seconds": time.perf_counter() - began})
    print(f"{'budget ε':>9} {'filter orders':>20} {'filter':>7} {'grid rule':>10} {'PLD, non-adaptive':>18}")
    for row in rows:
        orders = " ".join(f"{order:g}" for order in row["filter"]["orders"])
        print(f"{row['budget_epsilon']:>9g} {orders:>20} {row['filter_runs']:>7} {row['grid_rule_runs']:>10} "
              f"{row['non_adaptive_pld_runs']:>18}")
    if args.json:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
        RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine,
                                       "seed_job": SEED_JOB.to_dict(), "results": rows}, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
