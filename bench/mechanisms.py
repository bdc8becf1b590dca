"""DP-SGD against BandMF against DP-FTRL at the same ε and the same tuning budget: `python -m bench.mechanisms`.

For each ScatterNet example config (MNIST and Fashion-MNIST at ε ≤ 1 and
ε ≤ 3), each mechanism is tuned by `dpfleet tune` over the same learning-rate
grid (every trial an ordinary job, calibrated to the config's ε and charged
to the embedded ledger as tuning is), and the best trial is reported with the
ε of the choice (all trials composed). BandMF runs amplified (cyclic Poisson)
with the band width of least prefix-sum RMSE at the target ε, chosen before
any data is read; DP-FTRL runs fixed-order epochs with a tree per epoch and
tree completion. A config with shards (`--configs silos_band_mf`) runs BandMF
in fixed order, with bands up to an epoch wide among the candidates. `--json`
writes bench/results/mechanisms.json after every tuning, with the date, the
machine and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from accounting.matrix_mechanisms import banded_prefix_rmse
from orchestrator.cli import main as dpfleet
from orchestrator.cli.display import format_table
from orchestrator.config import load_config
from orchestrator.planning import plan_run
from workers.data import dataset_size
from workers.shards import worker_bounds

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "mechanisms.json"
CONFIGS = ("mnist_scatternet_eps1", "fashion_mnist_scatternet_eps1", "mnist_scatternet_eps3",
           "fashion_mnist_scatternet_eps3")
MECHANISMS = {
    "dp-sgd": {"mechanism": "dp-sgd", "sampler": "poisson", "band_width": 1},
    "band-mf": {"mechanism": "band-mf", "sampler": "cyclic-poisson"},
    "dp-ftrl": {"mechanism": "dp-ftrl", "sampler": "fixed-order", "band_width": 1, "tree_completion": True},
}
# With shards the silos take part in a fixed order (cyclic Poisson is refused there).
SILO_MECHANISMS = {**MECHANISMS, "band-mf": {"mechanism": "band-mf", "sampler": "fixed-order"}}
BAND_WIDTHS = (1, 2, 4, 8)
# Under fixed order every band up to an epoch has the same sensitivity: the wider ones are candidates too.
FIXED_ORDER_BAND_WIDTHS = (*BAND_WIDTHS, 16, 32)


def planned(path: Path, overrides: dict):
    """The plan of the config with `overrides`; with shards, for the N their workers will report (from metadata)."""
    config = load_config(str(path), overrides)
    if not config.shards:
        return plan_run(config)
    return plan_run(config, sum(stop - start for shard in config.shards for worker in range(shard.workers)
                                for start, stop in [worker_bounds(dataset_size(shard.dataset), shard, worker)]))


def prefix_rmse(path: Path, overrides: dict) -> tuple[float, float, int]:
    """(σ, the per-coordinate RMSE of the prefix sums in clip norms, steps) of the config with `overrides`."""
    plan = planned(path, overrides)
    if plan.correlation is None:
        return plan.noise_multiplier, banded_prefix_rmse([1.0], plan.steps, 1.0, plan.noise_multiplier), plan.steps
    return plan.noise_multiplier, plan.correlation.prefix_rmse(plan.noise_multiplier), plan.steps


def band_widths(path: Path, overrides: dict) -> list[int]:
    """The band widths to choose among: BAND_WIDTHS, and under fixed order the wider ones up to an epoch."""
    if overrides["sampler"] != "fixed-order":
        return list(BAND_WIDTHS)
    steps_per_epoch = planned(path, {**overrides, "band_width": 1}).correlation.steps_per_epoch
    return sorted({width for width in FIXED_ORDER_BAND_WIDTHS if width <= steps_per_epoch} | {steps_per_epoch})


def best_band_width(path: Path, overrides: dict) -> tuple[int, list[dict]]:
    """The band width of least prefix RMSE at the config's ε (data-independent: it reads no example)."""
    tried = []
    for band_width in band_widths(path, overrides):
        sigma, rmse, _ = prefix_rmse(path, {**overrides, "band_width": band_width})
        tried.append({"band_width": band_width, "noise_multiplier": sigma, "prefix_rmse": rmse})
    return min(tried, key=lambda row: row["prefix_rmse"])["band_width"], tried


def tune(path: Path, overrides: dict, learning_rates: list[float], run_dir: Path) -> dict:
    """`dpfleet tune` of the config with `overrides` over `learning_rates`; its tuning.json."""
    with tempfile.TemporaryDirectory() as scratch:
        config_file = Path(scratch) / "config.toml"
        # The example's own lines, but for the keys overridden, then the overrides (TOML takes a key once).
        lines = [line for line in path.read_text().splitlines()
                 if line.split("=")[0].strip() not in overrides]
        lines += [f"{name} = {json.dumps(value)}" for name, value in overrides.items()]
        config_file.write_text("\n".join(lines) + "\n")
        grid = Path(scratch) / "grid.toml"
        grid.write_text(f"learning_rate = {json.dumps(learning_rates)}\n")
        status = dpfleet(["tune", "--config", str(config_file), "--grid", str(grid), "--run-dir", str(run_dir),
                          "--no-progress"])
    if status != 0:
        raise SystemExit(f"dpfleet tune failed ({status}) for {path.name} {overrides}")
    return json.loads((run_dir / "tuning.json").read_text())


def main(argv: list[str] | None = None) -> int:
    """Tune every mechanism on every config and write the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), help="example config names to run")
    parser.add_argument("--mechanisms", nargs="*", default=list(MECHANISMS), help="mechanisms to compare")
    parser.add_argument("--epochs", type=float, help="override each config's epochs (the same for every mechanism)")
    parser.add_argument("--model", help="override each config's model (the same for every mechanism)")
    parser.add_argument("--learning-rate-factors", type=float, nargs="*", default=[1.0, 0.5],
                        help="the grid: the config's learning rate times these (default 1 and 0.5)")
    parser.add_argument("--json", action="store_true", help="also write the results (after each tuning, so a "
                        "partial run keeps what it finished)")
    parser.add_argument("--output", default=str(RESULTS), help=f"where --json writes (default {RESULTS.name})")
    args = parser.parse_args(argv)
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
        "command": "python -m bench.mechanisms " + " ".join(sys.argv[1:] if argv is None else argv),
        "results": [],
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    for name in args.configs:
        path = ROOT / "examples" / f"{name}.toml"
        base = load_config(str(path), {})
        learning_rates = [base.learning_rate * factor for factor in args.learning_rate_factors]
        for mechanism in args.mechanisms:
            overrides = dict((SILO_MECHANISMS if base.shards else MECHANISMS)[mechanism])
            if args.epochs is not None:
                overrides["epochs"] = args.epochs
            if args.model is not None:
                overrides["model"] = args.model
            band_choice = None
            if mechanism == "band-mf":
                overrides["band_width"], band_choice = best_band_width(path, overrides)
            sigma, rmse, steps = prefix_rmse(path, overrides)
            # Each mechanism's search is charged to a ledger dataset of its own (the default budget, ε 10, each).
            outcome = tune(path, {**overrides, "dataset_name": f"bench-mechanisms-{name}-{mechanism}"},
                           learning_rates, ROOT / "runs" / "bench-mechanisms" / name / mechanism)
            best = outcome["best"]
            record["results"].append({
                "config": f"examples/{name}.toml", "mechanism": mechanism, "overrides": overrides,
                "steps": steps, "noise_multiplier": sigma, "prefix_rmse": rmse, "band_choice": band_choice,
                "learning_rates": learning_rates, "trials": len(outcome["trials"]),
                "best_learning_rate": best["overrides"]["learning_rate"], "test_accuracy": best["test_accuracy"],
                "epsilon_per_trial": best["epsilon"], "selection_epsilon": outcome["selection_epsilon"],
                "delta": outcome["delta"], "wall_seconds": sum(trial["wall_seconds"] for trial in outcome["trials"]),
                "all_trials": [{"learning_rate": trial["overrides"]["learning_rate"],
                                "test_accuracy": trial["test_accuracy"]} for trial in outcome["trials"]],
            })
            if args.json:
                output.write_text(json.dumps(record, indent=2))
            print(json.dumps(record["results"][-1]), flush=True)
    print(format_table(
        ["config", "mechanism", "steps", "σ", "prefix RMSE", "best lr", "test accuracy", "ε per trial",
         "ε of the choice"],
        [[row["config"], row["mechanism"] + (f" (b={row['overrides']['band_width']})" if row["band_choice"] else ""),
          row["steps"], f"{row['noise_multiplier']:.3g}", f"{row['prefix_rmse']:.3g}", row["best_learning_rate"],
          f"{100 * row['test_accuracy']:.2f}%", f"{row['epsilon_per_trial']:.3g}", f"{row['selection_epsilon']:.3g}"]
         for row in record["results"]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
