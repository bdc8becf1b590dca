"""`dpfleet ledger plan register`: RUNS runs of a training config's job as one pre-registered plan.

It plans the job as `dpfleet train` would, reading the data's size, so it is
a module of its own, as `fits` is; `dpfleet ledger plan list` is with the
other listings (orchestrator.cli.ledger).
"""

from __future__ import annotations

import argparse

from orchestrator import checks
from orchestrator.cli.display import format_number, print_json
from orchestrator.cli.ledger import ledger_command, ledger_from_flags
from orchestrator.config import load_config
from orchestrator.ledger_session import ledger_dataset_name, register_plan_of


@ledger_command
def run_plan_register(args: argparse.Namespace) -> int:
    """Register RUNS runs of a training config's job as one plan, charged its PLD ε from the plan pool now."""
    config = load_config(args.config, {})
    runs = checks.integer_at_least("--runs", args.runs, 1)
    delta = None if args.delta is None else checks.positive_number("--delta", args.delta)
    dataset = ledger_dataset_name(args.dataset_name, config)
    args.ledger = args.ledger or config.ledger
    with ledger_from_flags(args) as ledger:
        plan = register_plan_of(ledger, dataset, args.name, [config] * runs, delta)
        status = ledger.get_budget(dataset, pld_may_be_pending=True)
    if args.json:
        print_json({"plan": plan.to_dict(), "pool": status.to_dict()["plan_pool"]})
        return 0
    print(f"plan {plan.name!r} on dataset {dataset!r}: {len(plan.jobs)} run(s) of {args.config}, charged ε "
          f"{format_number(plan.epsilon)} at δ {plan.delta:g} (PLD, all runs composed) from the plan pool, which has "
          f"ε {format_number(status.admission.plan_epsilon - status.plans_epsilon)} left.\n"
          f"run each with: dpfleet train --config {args.config} --plan {plan.name}. Runs that never start are not "
          "refunded.")
    return 0
