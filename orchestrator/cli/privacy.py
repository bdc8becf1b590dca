"""`dpfleet eps` and `dpfleet noise`: the accountants from the command line."""

from __future__ import annotations

import argparse
import sys
import warnings

from accounting.accountants import ACCOUNTANTS, DEFAULT_ACCOUNTANT, get_accountant, label
from accounting.calibration import UnreachableTargetError, noise_multiplier_for
from accounting.events import SampledGaussian, steps_for_epochs
from orchestrator import checks
from orchestrator.cli.display import format_table, print_json
from orchestrator.errors import UsageError

ACCOUNTANT_CHOICES = list(ACCOUNTANTS) + ["all"]

_STEPS_HELP = (
    "--epochs E is turned into steps = ceil(E * N / B), with N the dataset size and B the "
    "expected batch size; the sampling rate is q = B / N (Poisson sampling)."
)


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-size", required=True, help="number of training examples N (integer >= 1)")
    parser.add_argument("--batch-size", required=True, help="expected batch size B (integer, 1 <= B <= N)")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", help="passes over the data (> 0); see the note below")
    length.add_argument("--steps", help="number of DP-SGD steps (integer >= 1)")
    parser.add_argument("--delta", required=True, help="target delta, in (0, 1)")
    parser.add_argument(
        "--accountant",
        default=DEFAULT_ACCOUNTANT,
        help="pld (default, rigorous), rdp (rigorous), gdp (approximate) or all",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_eps_arguments(eps: argparse.ArgumentParser) -> None:
    """The arguments of `eps`."""
    eps.description = "Epsilon of a DP-SGD run with Poisson sampling and Gaussian noise."
    eps.epilog = _STEPS_HELP
    eps.add_argument("--noise-multiplier", required=True, help="noise std / clip norm, sigma > 0")
    eps.add_argument(
        "--microbatch-size",
        help="clip groups of about k examples (TF Privacy / MindArmour microbatches): one example then moves "
        "a group's clipped gradient by up to 2C, so epsilon is computed with sensitivity factor 2",
    )
    _add_run_flags(eps)
    eps.set_defaults(handler=f"{__name__}:run_eps")


def add_noise_arguments(noise: argparse.ArgumentParser) -> None:
    """The arguments of `noise`."""
    noise.description = "Smallest noise multiplier (to 0.1%%) that meets a target epsilon."
    noise.epilog = _STEPS_HELP
    noise.add_argument("--target-epsilon", required=True, help="the epsilon to meet, > 0")
    _add_run_flags(noise)
    noise.set_defaults(handler=f"{__name__}:run_noise")


def _run_shape(args: argparse.Namespace) -> tuple[float, int, float, list[str]]:
    """Validated (sampling_rate, steps, delta, accountant names) from the shared flags."""
    dataset_size = checks.integer_at_least("--dataset-size", args.dataset_size, 1)
    batch_size = checks.integer_at_least("--batch-size", args.batch_size, 1)
    sampling_rate = checks.batch_within_dataset("--batch-size", batch_size, dataset_size)
    if args.epochs is not None:
        epochs = checks.positive_number("--epochs", args.epochs)
        steps = steps_for_epochs(epochs, dataset_size, batch_size)
    else:
        steps = checks.integer_at_least("--steps", args.steps, 1)
    delta = checks.open_unit_interval("--delta", args.delta)
    accountant = checks.one_of("--accountant", args.accountant, ACCOUNTANT_CHOICES)
    names = list(ACCOUNTANTS) if accountant == "all" else [accountant]
    return sampling_rate, steps, delta, names


def _report(rows: list[dict], as_json: bool, all_accountants: bool) -> None:
    if as_json:
        print_json(rows if all_accountants else rows[0])
        return
    headers = ["accountant", "epsilon", "delta", "noise multiplier", "steps", "sampling rate", "rigorous"]
    table_rows = [
        [
            label(get_accountant(row["accountant"])),
            row["epsilon"],
            row["delta"],
            row["noise_multiplier"],
            row["steps"],
            row["sampling_rate"],
            row["rigorous"],
        ]
        for row in rows
    ]
    print(format_table(headers, table_rows))
    if any(not row["rigorous"] for row in rows):
        print("gdp is a central-limit approximation: it can fall below the true epsilon; use pld for budgets.")


def _row(name: str, event: SampledGaussian, epsilon: float, delta: float) -> dict:
    return {
        "accountant": name,
        "epsilon": epsilon,
        "delta": delta,
        "steps": event.steps,
        "sampling_rate": event.sampling_rate,
        "noise_multiplier": event.noise_multiplier,
        "rigorous": get_accountant(name).rigorous,
    }


def run_eps(args: argparse.Namespace) -> int:
    """Print the epsilon of the described run under one or all accountants."""
    noise_multiplier = checks.positive_number("--noise-multiplier", args.noise_multiplier)
    sampling_rate, steps, delta, names = _run_shape(args)
    microbatches = args.microbatch_size is not None
    if microbatches:
        checks.integer_at_least("--microbatch-size", args.microbatch_size, 1)
    event = SampledGaussian(sampling_rate, noise_multiplier, steps, 2.0 if microbatches else 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = [_row(name, event, get_accountant(name).epsilon(event, delta), delta) for name in names]
        if microbatches:
            for row in rows:
                row["sensitivity_factor"] = 2.0
                row["epsilon_without_factor"] = get_accountant(row["accountant"]).epsilon(
                    event.with_sensitivity(1.0), delta)
    _report(rows, args.json, len(names) > 1)
    if microbatches and not args.json:
        print("microbatches: one example moves its group's clipped gradient by up to 2C, so epsilon uses "
              "sensitivity factor 2; TF Privacy's reported figure omits it (without it: "
              + ", ".join(f"{row['accountant']} {row['epsilon_without_factor']:.4g}" for row in rows) + ")")
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    return 0


def run_noise(args: argparse.Namespace) -> int:
    """Print the smallest noise multiplier meeting the target epsilon, and the epsilon it achieves."""
    target = checks.positive_number("--target-epsilon", args.target_epsilon)
    sampling_rate, steps, delta, names = _run_shape(args)
    rows = []
    for name in names:
        try:
            sigma = noise_multiplier_for(target, delta, sampling_rate, steps, name)
        except UnreachableTargetError as error:
            raise UsageError(f"--target-epsilon: {error}") from None
        event = SampledGaussian(sampling_rate, sigma, steps)
        row = _row(name, event, get_accountant(name).epsilon(event, delta), delta)
        row["target_epsilon"] = target
        rows.append(row)
    _report(rows, args.json, len(names) > 1)
    return 0
