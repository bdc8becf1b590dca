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
  at all when they are not;
- pre-registered plans: on a dataset that sets a share of its budget aside
  as a plan pool (99%, then 50%), the most runs one plan holding them all
  may declare, registered through the ledger at the pool's delta, and then
  the runs the filter admits on the rest.

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
from accounting.ledger.admission import PoolUse, RdpTally, fits_budget, plan_epsilon, pool_admits
from accounting.ledger.errors import BudgetExceeded
from accounting.ledger.store import open_embedded_ledger

SEED_JOB = SampledGaussian(250 / 60000, 1.3, 3600)
DELTA = 1e-5
BUDGETS = (1.0, 3.0, 10.0)
# Shares of the budget set aside as the plan pool.
PLAN_SHARES = (0.99, 0.5)
RESULTS = Path(__file__).resolve().parent / "results" / "admission.json"


def filter_admits(ledger) -> int:
    """Reserve and commit the seed job on the ledger's dataset "seed" until its filter refuses; the count."""
    runs = 0
    while True:
        try:
            reservation = ledger.reserve("seed", f"run-{runs}", SEED_JOB)
        except BudgetExceeded:
            return runs
        ledger.commit(reservation.reservation_id, SEED_JOB.steps, 0)
        runs += 1


def admitted_by_the_ledger(budget_epsilon: float, plan_share: float = 0.0) -> tuple[int, int, dict]:
    """On a fresh ledger, a dataset of `budget_epsilon` with `plan_share` set aside as its plan pool: the most
    seed runs one plan may hold (registered through the ledger at the pool's delta; 0 without a pool), then the
    runs its filter admits, and the dataset's rule."""
    with tempfile.TemporaryDirectory(prefix="dpfleet-admission-") as folder:
        with open_embedded_ledger(Path(folder) / "ledger.db") as ledger:
            rule = ledger.create_dataset("seed", budget_epsilon, DELTA, plan_share=plan_share).admission
            plan_runs = 0
            if rule.has_plan_pool:
                pool_delta = rule.plan_delta
                plan_runs = most_runs(lambda runs: pool_admits(
                    rule, PoolUse(), plan_epsilon([SEED_JOB] * runs, pool_delta), pool_delta))
                if plan_runs:
                    ledger.register_plan("seed", "every-run", [SEED_JOB] * plan_runs, delta=pool_delta)
            return plan_runs, filter_admits(ledger), rule.to_dict()


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
        _, filter_runs, rule = admitted_by_the_ledger(budget_epsilon)
        plans = {f"{share:g}": dict(zip(("plan_runs", "filter_runs"), admitted_by_the_ledger(budget_epsilon, share)))
                 for share in PLAN_SHARES}
        grid_runs = most_runs(
            lambda runs: fits_budget(RdpTally.of(repeated(runs)).epsilon(DELTA), budget_epsilon)
        )
        pld_runs = most_runs(lambda runs: pld.epsilon(repeated(runs), DELTA) < budget_epsilon)
        rows.append({"budget_epsilon": budget_epsilon, "delta": DELTA, "filter_runs": filter_runs,
                     "grid_rule_runs": grid_runs, "non_adaptive_pld_runs": pld_runs, "filter": rule,
                     "plans_by_share": plans,
                     "seconds": time.perf_counter() - began})
    shares = "".join(f" {f'plan + filter, {share:.0%} pool':>26}" for share in PLAN_SHARES)
    print(f"{'budget ε':>9} {'filter orders':>20} {'filter':>7} {'grid rule':>10} {'PLD, non-adaptive':>18}{shares}")
    for row in rows:
        orders = " ".join(f"{order:g}" for order in row["filter"]["orders"])
        plans = "".join(" " + f"{part['plan_runs']} + {part['filter_runs']}".rjust(26)
                        for part in row["plans_by_share"].values())
        print(f"{row['budget_epsilon']:>9g} {orders:>20} {row['filter_runs']:>7} {row['grid_rule_runs']:>10} "
              f"{row['non_adaptive_pld_runs']:>18}{plans}")
    if args.json:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
        RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine,
                                       "seed_job": SEED_JOB.to_dict(), "results": rows}, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
