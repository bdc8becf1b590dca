"""`dpfleet tune`: a grid or random search, each trial an ordinary dpfleet job charged to the ledger."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from accounting.accountants import get_accountant, labelled_epsilon
from accounting.events import Composition
from orchestrator.cli.display import format_table, print_json, show_progress
from orchestrator.cli.train import add_job_ledger_flags, check_queue_flags, job_ledger
from orchestrator.config import load_config, read_toml
from orchestrator.trainer import Trainer
from orchestrator.tuning import best_trial, grid_trials, parse_grid, random_trials, selection_events


def add_tune_arguments(tune: argparse.ArgumentParser) -> None:
    """The arguments of `tune`."""
    tune.description = (
        "Run a grid (or, with --trials, a random subset of it) of configurations, one ordinary dpfleet job\n"
        "after another on Ray, each reserved and charged on the ledger like `dpfleet train`. The best trial\n"
        "by the config's first test metric is reported with the epsilon of all the trials composed: picking\n"
        "it looked at every trial, so that is what the picked model costs."
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


def run_tune(args: argparse.Namespace) -> int:
    """Run every trial as a charged job, then report the trials, the best one and the ε of choosing it."""
    check_queue_flags(args)
    grid = parse_grid(read_toml(args.grid, "grid"))
    trials = (grid_trials(grid) if args.trials is None
              else random_trials(grid, args.trials, np.random.default_rng(args.search_seed)))
    configs = [load_config(args.config, {**overrides, "run_dir": str(Path(args.run_dir) / f"trial-{index}")},
                           overrides_from=args.grid)
               for index, overrides in enumerate(trials)]
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
