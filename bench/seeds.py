"""The four seed tutorials on dpfleet: `python -m bench.seeds [--json]`.

Runs each tutorial's configuration from examples/ through the real trainer
and prints, beside what the tutorial itself reported, dpfleet's test accuracy
and rigorous (PLD) epsilon for the same setup. `--json` also writes
bench/results/seeds.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.mnist import ROOT, run_config
from orchestrator.display import format_table

RESULTS = Path(__file__).resolve().parent / "results" / "seeds.json"

# What each tutorial reports for its own run (None: the tutorial gives no figure).
TUTORIALS = {
    "gdp_tutorial": {"reported_accuracy": 0.968, "reported_epsilon": "0.94 (RDP), 0.82 (GDP, approximate)"},
    "tf_privacy_tutorial": {"reported_accuracy": 0.95, "reported_epsilon": "0.563 (RDP, no microbatch factor)"},
    "mindarmour_lenet5": {"reported_accuracy": 0.9698, "reported_epsilon": None},
    "opacus_tutorial": {"reported_accuracy": None, "reported_epsilon": None},
}


def main(argv: list[str] | None = None) -> int:
    """Run every tutorial configuration and print the comparison table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=sorted(TUTORIALS), help="run just these tutorials")
    parser.add_argument("--json", action="store_true", help="also write bench/results/seeds.json")
    args = parser.parse_args(argv)
    results = []
    for name in args.only or list(TUTORIALS):
        row = run_config(str(ROOT / "examples" / f"{name}.toml"))
        results.append({"tutorial": name, **TUTORIALS[name], **row})
    print(format_table(
        ["tutorial", "reported accuracy", "reported epsilon", "dpfleet accuracy", "dpfleet PLD epsilon", "wall"],
        [[row["tutorial"],
          "–" if row["reported_accuracy"] is None else f"{100 * row['reported_accuracy']:.2f}%",
          row["reported_epsilon"] or "–",
          f"{100 * row['test_accuracy']:.2f}%", row["epsilon_pld"], f"{row['wall_seconds']:.0f} s"]
         for row in results],
    ))
    if args.json:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
