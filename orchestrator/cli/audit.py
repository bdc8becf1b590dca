"""`dpfleet audit`: one training run with canaries, an epsilon lower bound next to the accountant's."""

from __future__ import annotations

import argparse
import sys

from orchestrator import checks
from orchestrator.audit import DEFAULT_CANARIES, MIN_CANARIES, MODES, run_audit
from orchestrator.config import load_config
from orchestrator.cli.display import format_table, print_json, show_progress
from orchestrator.errors import UsageError


def add_audit_arguments(audit: argparse.ArgumentParser) -> None:
    """The arguments of `audit`."""
    audit.description = (
        "Train the config once through the real pipeline with canaries, each included with "
        "probability 1/2, guess which were included, and turn the guesses into a lower bound on "
        "epsilon (Steinke, Nasr and Jagielski 2023) next to the accountant's upper bound (PLD)."
    )
    audit.epilog = (
        "A lower bound above the upper bound means the implementation leaks more than the accountant "
        "claims. The run is not charged to the privacy ledger."
    )
    audit.add_argument("--config", required=True, help="TOML file with the run's keys (see examples/audit.toml)")
    audit.add_argument(
        "--canaries",
        help=f"number of canaries, integer >= {MIN_CANARIES} (default {DEFAULT_CANARIES['white-box']} white-box, "
        f"{DEFAULT_CANARIES['black-box']} black-box)",
    )
    audit.add_argument("--confidence", default="0.95", help="confidence of the lower bound, in (0, 1) (default 0.95)")
    audit.add_argument(
        "--mode",
        default="white-box",
        help="white-box (gradient canaries, all noisy sums seen; default) or black-box "
        "(mislabelled examples, final model only)",
    )
    audit.add_argument(
        "--rows-per-canary",
        default="1",
        help="rows each canary owns, integer >= 1 (default 1); above 1 each white-box canary is a person whose rows "
        'all push one coordinate: one sampled user under privacy_unit = "user", else rows sampled one by one',
    )
    audit.add_argument("--run-dir", help="where audit.json, audit_scores.png and the run's files go")
    audit.add_argument("--seed", help="fixed seed for sampling, noise and canaries: tests only, never production")
    audit.add_argument("--no-progress", action="store_true",
                       help="hide the progress bars (shown only when stderr is a terminal)")
    audit.add_argument("--json", action="store_true", help="print the audit as JSON on the last line")
    audit.set_defaults(handler=f"{__name__}:run_audit_command")


def run_audit_command(args: argparse.Namespace) -> int:
    """Validate the flags and config, run the audit, print a table (or JSON) ending with the verdict."""
    mode = checks.one_of("--mode", args.mode, MODES)
    canaries = None if args.canaries is None else checks.integer_at_least("--canaries", args.canaries, MIN_CANARIES)
    confidence = checks.open_unit_interval("--confidence", args.confidence)
    rows_per_canary = checks.integer_at_least("--rows-per-canary", args.rows_per_canary, 1)
    try:
        config = load_config(args.config, {"run_dir": args.run_dir, "seed": args.seed})
    except ValueError as error:
        raise UsageError(str(error)) from None
    result = run_audit(config, canaries=canaries, confidence=confidence, mode=mode, rows_per_canary=rows_per_canary,
                       show_progress=show_progress(args.no_progress, sys.stderr))
    if args.json:
        print_json(result)
        return 0
    print(format_table(["audit", "value"], audit_rows(result)))
    print(result["verdict"])
    return 0


def audit_rows(result: dict) -> list[list]:
    """The table rows of an audit result (see `orchestrator.audit.run_audit`)."""
    membership, canary = result["membership"], result["canary_membership"]
    unit = "per user" if result["privacy_unit"] == "user" else "per example"
    rows = [
        [f"epsilon lower bound ({result['confidence']:.0%} confidence)", result["epsilon_lower"]],
        [f"epsilon upper bound (accountant, pld, {unit})", result["epsilon_upper"]],
        ["delta", result["delta"]],
        ["mode", result["mode"]],
        ["canaries", result["canaries"]],
        ["rows per canary", result["rows_per_canary"]],
        ["guesses (in + out)", f"{result['guesses']} ({result['guesses_in']} + {result['guesses_out']})"],
        ["correct guesses", result["correct"]],
        ["canary AUC", canary["auc"]],
        ["membership inference AUC (loss, train vs test)", membership["auc"]],
        ["membership inference TPR at 1% FPR", membership["tpr_at_1pct_fpr"]],
        ["test accuracy", result["test_accuracy"]],
        ["steps", result["steps"]],
        ["sampling rate", result["sampling_rate"]],
        ["noise multiplier", result["noise_multiplier"]],
        ["score histograms", result["scores_png"]],
    ]
    if result["epsilon_upper_person"] is not None:
        rows.insert(2, [f"epsilon upper bound, person of {result['rows_per_canary']} rows (group privacy, "
                        f"{result['epsilon_upper_person_accountant']})", result["epsilon_upper_person"]])
    return rows
