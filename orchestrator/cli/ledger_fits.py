"""`dpfleet ledger fits`: plan a training config's job as `dpfleet train` would, and ask the ledger if it fits.

Planning reads the data's size from its metadata and loads no torch or Ray
(orchestrator.planning); it reads the data's files, so it is a module of its
own. The config's check loads none either: the model, engine, loss and
metrics names it checks are the workers' registries' torch-free lists
(workers.names). A config that names its own model or loss module,
train_transforms or shards, still loads what those load.
"""

from __future__ import annotations

import argparse

from accounting.accountants import get_accountant, labelled_epsilon
from orchestrator.cli.display import format_number, format_table, print_json
from orchestrator.cli.ledger import ledger_command, ledger_from_flags
from orchestrator.config import load_config
from orchestrator.ledger_session import (
    filter_charges,
    fits_takes,
    job_fits_now,
    ledger_dataset_name,
    takes_phrase,
)


def pool_note(status) -> str:
    """Beside a dataset's budget in words: the plan pool it set aside, when it has one ('' otherwise)."""
    if not status.admission.has_plan_pool:
        return ""
    return (f" for the filter, and a plan pool of ε {status.admission.plan_epsilon:g} at δ "
            f"{status.admission.plan_delta:g} beside it")


@ledger_command
def run_fits(args: argparse.Namespace) -> int:
    """Say whether a training config's job would be admitted now, what it takes from each budget and what would
    remain; on a dataset the embedded ledger does not hold yet, as `dpfleet train` would register it."""
    config = load_config(args.config, {})
    dataset = ledger_dataset_name(args.dataset_name, config)
    # The ledger the job would use: --ledger, else the config's, else DPFLEET_LEDGER (as dpfleet train does).
    args.ledger = args.ledger or config.ledger
    with ledger_from_flags(args) as ledger:
        plan, status, report, registered = job_fits_now(ledger, dataset, config)
    takes = fits_takes(report)
    epsilon, shown = labelled_epsilon(get_accountant(config.accountant), plan.planned_events, config.delta)
    first_use = None if registered else {"budget_epsilon": status.budget_epsilon, "delta": status.delta,
                                         "privacy_unit": status.privacy_unit, "blocks": list(config.blocks)}
    if args.json:
        print_json({**report.to_dict(), "steps": plan.steps, "sampling_rate": plan.sampling_rate,
                    "noise_multiplier": plan.noise_multiplier, "epsilon": epsilon, "epsilon_accountant": shown,
                    "registered": registered, "first_use": first_use,
                    "takes": [{"block": block, "epsilon": taken, "remaining_epsilon": remaining,
                               "remaining_after_epsilon": remaining - taken} for block, taken, remaining in takes],
                    "filter_charges": [{"budget": name, "filter_epsilon": charge}
                                       for name, charge in filter_charges(plan, status, config.blocks)]})
        return 0 if report.fits else 3
    rows = [
        [check.budget, check.budget_epsilon, check.held_epsilon, check.needed_epsilon, check.remaining_epsilon,
         check.remaining_after_epsilon, "yes" if check.fits else "no"]
        for check in report.checks
    ]
    print(format_table(
        ["budget", "budget ε", "held ε", "job takes ε", "remaining ε now", "remaining ε after", "fits"], rows
    ))
    verdict = "fits" if report.fits else "does not fit"
    registration = "" if registered else (
        f"dataset {dataset!r} is not registered: dpfleet train would register it with budget ε "
        f"{status.budget_epsilon:g} at δ {status.delta:g}{' per person' if status.privacy_unit == 'user' else ''}"
        f"{pool_note(status)}"
        f"{' and blocks ' + ', '.join(config.blocks) if config.blocks else ''} on first use; nothing is registered "
        "now.\n"
    )
    print(
        f"\n{registration}the job ({plan.steps} steps at q = {format_number(plan.sampling_rate)}, σ "
        f"{format_number(plan.noise_multiplier)}) {verdict} now; nothing was reserved. ε are the filters' at "
        "each budget's δ; another job may change the answer before this one runs.\n"
        f"this job would take {takes_phrase(takes)}; its own privacy: ε {epsilon:.3g} ({shown}, δ "
        f"{config.delta:g})"
    )
    return 0 if report.fits else 3
