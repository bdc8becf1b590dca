"""`python -m bench` (`make bench`): every benchmark in turn, each writing bench/results/*.json."""

from __future__ import annotations

import sys

from bench import (
    admission, cli_startup, fan_in, fine_tuning, ledger, ledger_commit_profile, ledger_fairness, ledger_growth,
    mechanisms, mnist, out_of_core, precision, scaling, scheduling, secure_aggregation, seeds, throughput,
)

BENCHMARKS = {
    "throughput": throughput.main,
    "precision": precision.main,
    "fine_tuning": fine_tuning.main,
    "ledger": ledger.main,
    "ledger_fairness": ledger_fairness.main,
    "ledger_commit_profile": ledger_commit_profile.main,
    "ledger_growth": ledger_growth.main,
    "admission": admission.main,
    "scheduling": scheduling.main,
    "mnist": mnist.main,
    "mechanisms": mechanisms.main,
    "seeds": seeds.main,
    "out_of_core": out_of_core.main,
    "scaling": scaling.main,
    "fan_in": fan_in.main,
    "cli_startup": cli_startup.main,
    "secure_aggregation": secure_aggregation.main,
}


def main(argv: list[str]) -> int:
    """Run the named benchmarks (all by default) with --json; return the worst exit status."""
    names = argv or list(BENCHMARKS)
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    status = 0
    for name in names:
        print(f"== bench.{name}", flush=True)
        status = max(status, BENCHMARKS[name](["--json"]))
    return status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
