"""The four seed tutorials on dpfleet: `python -m bench.seeds [--json]`.

Runs each tutorial's configuration from examples/ through the real trainer
and prints, beside what the tutorial itself reported, dpfleet's test accuracy
and rigorous (PLD) epsilon for the same setup. `--json` also writes
bench/results/seeds.json, replacing the rows of the tutorials just run and
keeping the others (a full run takes about half an hour on 2 cores).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from accounting.accountants import PLD_FALLBACK_LABEL, get_accountant, label
from bench.mnist import ROOT, run_config
from orchestrator.cli.display import format_table

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
    parser.add_argument("--json", action="store_true", help="also write (update) bench/results/seeds.json")
    parser.add_argument("--markdown", action="store_true",
                        help="run nothing; print bench/results/seeds.json as docs/benchmarks.md's Markdown table")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(RESULTS.read_text())))
        return 0
    results = []
    for name in args.only or list(TUTORIALS):
        row = run_config(str(ROOT / "examples" / f"{name}.toml"))
        results.append({"tutorial": name, **TUTORIALS[name], **row})
    print(format_table(HEADERS, [_cells(row) for row in results]))
    if args.json:
        write_results(results)
    return 0


HEADERS = ["tutorial", "reported accuracy", "reported epsilon", "dpfleet accuracy", "dpfleet epsilon", "wall"]


def _cells(row: dict) -> list[str]:
    """One table row: the tutorial's figures beside dpfleet's, with the accountant behind dpfleet's epsilon."""
    accountant = PLD_FALLBACK_LABEL if row.get("pld_fell_back_to_rdp") else label(get_accountant("pld"))
    return [
        row["tutorial"],
        "–" if row["reported_accuracy"] is None else f"{100 * row['reported_accuracy']:.2f}%",
        row["reported_epsilon"] or "–",
        f"{100 * row['test_accuracy']:.2f}%",
        f"{row['epsilon_pld']:.4g} ({accountant})",
        f"{row['wall_seconds']:.0f} s",
    ]


def markdown_table(rows: list[dict]) -> str:
    """The rows as a GitHub Markdown table, for docs/benchmarks.md."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    return "\n".join(lines + ["| " + " | ".join(_cells(row)) + " |" for row in rows])


def write_results(results: list[dict]) -> None:
    """Update bench/results/seeds.json: these tutorials' rows replace their earlier ones, in TUTORIALS order."""
    rows = {row["tutorial"]: row for row in json.loads(RESULTS.read_text())} if RESULTS.exists() else {}
    rows.update({row["tutorial"]: row for row in results})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps([rows[name] for name in TUTORIALS if name in rows], indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
