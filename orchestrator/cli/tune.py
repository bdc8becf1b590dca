"""`dpfleet tune`: a grid or random search, each trial an ordinary dpfleet job charged to the ledger."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path

import numpy as np

from accounting.ledger.errors import BudgetExceeded

from accounting.accountants import get_accountant, labelled_epsilon
from accounting.events import Composition
from orchestrator.cli.display import format_table, print_json, show_progress
from orchestrator.cli.train import add_job_ledger_flags, check_queue_flags, job_ledger, register_embedded
from orchestrator.config import load_config, read_toml
from orchestrator.errors import BudgetRefusedError, UsageError
from orchestrator.ledger_session import ledger_dataset_name, open_ledger, register_plan_of
from orchestrator.trainer import Trainer
from orchestrator.tuning import best_trial, grid_trials, parse_grid, random_trials, selection_events


def add_tune_arguments(tune: argparse.ArgumentParser) -> None:
    """The arguments of `tune`."""
    tune.description = (
        "Run a grid (or, with --trials, a random subset of it) of configurations, one ordinary dpfleet job\n"
        "after another on Ray, each reserved and charged on the ledger like `dpfleet train`. The best trial\n"
        "by the config's first test metric is reported with the epsilon of all the trials composed: picking\n"
        "it looked at every trial, so that is what the picked model costs. On a dataset with a plan pool\n"
        "(dpfleet ledger dataset create --plan-share), the trials are registered first as one plan, charged\n"
        "that ε once; each then runs without the filter, and trials that never run are not refunded."
    )
    tune.add_argument("--config", required=True, help="TOML file with the keys every trial shares")
    tune.add_argument("--grid", required=True,
                      help="TOML file of config keys, each with a list of values: learning_rate = [1.0, 2.0]")
    tune.add_argument("--trials", type=int, help="try this many combinations drawn at random (default: all)")
    tune.add_argument("--search-seed", type=int, default=0,
                      help="seed of the random draw of combinations (it touches no data; default 0)")
    tune.add_argument("--run-dir", default="runs/tune", help="trial k runs in RUN_DIR/trial-k (default runs/tune)")
    add_job_ledger_flags(tune)
    tune.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    tune.add_argument("--json", action="store_true", help="print the search's result as JSON on the last line")
    tune.set_defaults(handler=f"{__name__}:run_tune")


def grid_plan(args: argparse.Namespace, configs: list) -> str | None:
    """Register the trials as one pre-registered plan, charged its PLD ε from the dataset's plan pool, and return
    its name; None, saying why, where each trial is admitted by the filter instead (a dataset without a plan pool,
    trials on other datasets or on blocks or shards)."""
    if args.plan is not None:
        raise UsageError("dpfleet tune registers its trials as a plan of its own; leave out --plan")
    ledger = open_ledger(args.ledger or configs[0].ledger, args.token)
    try:
        dataset = register_embedded(ledger, args.dataset_name, configs[0], print)
        if {ledger_dataset_name(args.dataset_name, config) for config in configs} != {dataset} or any(
            config.shards or config.blocks for config in configs
        ):
            print("tune: the trials are not all on one dataset's own budget (other datasets, blocks or shards); "
                  "each is admitted by the filter", flush=True)
            return None
        if not ledger.get_budget(dataset, pld_may_be_pending=True).admission.has_plan_pool:
            print(f"tune: dataset {dataset!r} has no plan pool, so each trial is admitted by the filter; a dataset "
                  "created with a plan share (dpfleet ledger dataset create NAME --plan-share 0.5) is charged the "
                  "grid once, at its PLD ε", flush=True)
            return None
        name = f"tune-{secrets.token_hex(4)}"
        try:
            plan = register_plan_of(ledger, dataset, name, configs)
        except BudgetExceeded as error:
            raise BudgetRefusedError(f"the ledger refused the grid as a plan: {error}") from None
    finally:
        ledger.close()
    print(f"tune: registered the {len(configs)} trials as plan {name!r}, charged ε {plan.epsilon:.4g} at δ "
          f"{plan.delta:g} (PLD, every trial composed) from the plan pool of {dataset!r}; trials that never run are "
          "not refunded", flush=True)
    return name


def run_tune(args: argparse.Namespace) -> int:
    """Run every trial as a charged job, then report the trials, the best one and the ε of choosing it."""
    check_queue_flags(args)
    grid = parse_grid(read_toml(args.grid, "grid"))
    trials = (grid_trials(grid) if args.trials is None
              else random_trials(grid, args.trials, np.random.default_rng(args.search_seed)))
    configs = [load_config(args.config, {**overrides, "run_dir": str(Path(args.run_dir) / f"trial-{index}")},
                           overrides_from=args.grid)
               for index, overrides in enumerate(trials)]
    args.plan = grid_plan(args, configs)
    results, trial_events = [], []
    for index, (overrides, config) in enumerate(zip(trials, configs)):
        print(f"tune: trial {index + 1} of {len(trials)}: {json.dumps(overrides, sort_keys=True)}", flush=True)
        trainer = Trainer(config, show_progress=show_progress(args.no_progress, sys.stderr))
        trainer.ledger = job_ledger(args, trainer)
        try:
            summary = trainer.run()
            trainer.ledger.release()
        finally:
            trainer.ledger.close()
        trial_events.append(Composition.from_dict(summary["events"]))
        results.append({"trial": index, "overrides": overrides, "run_dir": config.run_dir,
                        **{key: summary[key] for key in summary if key.startswith("test_")},
                        "epsilon": summary["epsilon"], "wall_seconds": summary["wall_seconds"]})
    metric = configs[0].metrics[0]
    best = best_trial(results, metric)
    delta = configs[0].delta
    epsilon, epsilon_label = labelled_epsilon(get_accountant(configs[0].accountant), selection_events(trial_events),
                                              delta)
    outcome = {"configurations_tried": len(results), "metric": f"test_{metric}", "best": results[best],
               "selection_epsilon": epsilon, "selection_epsilon_label": epsilon_label, "delta": delta,
               "trials": results}
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.run_dir) / "tuning.json").write_text(json.dumps(outcome, indent=2, sort_keys=True))
    if args.json:
        print_json(outcome)
        return 0
    rows = [[result["trial"], json.dumps(result["overrides"], sort_keys=True), result[f"test_{metric}"],
             result["epsilon"]] for result in results]
    print(format_table(["trial", "overrides", f"test {metric}", "epsilon (one trial)"], rows))
    print(format_table(["search", "value"], [
        ["configurations tried", len(results)],
        ["best trial", f"{best} ({results[best]['run_dir']})"],
        [f"best test {metric}", results[best][f"test_{metric}"]],
        [f"epsilon of the choice: all trials composed ({epsilon_label}, delta={delta:g})", epsilon],
    ]))
    return 0
