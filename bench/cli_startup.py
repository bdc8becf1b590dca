"""How fast the command line answers, beside a bare `import torch`: `python -m bench.cli_startup [--json]`.

Each command runs as a new process, as a user or a cron job runs it, in
rounds: one warm-up round (to fill the page cache), then ``--rounds`` rounds,
each running every command once in turn, so that a change in the machine's
load touches every command alike. The table gives each command's median wall
time and its ratio to the median of `python -c "import torch"`. `ledger
status --json` asks a `dpfleet ledger serve` that the benchmark starts on
loopback (as a cron job or an exporter asks a ledger server). The goals:
`--help`, `--version` and the ledger commands at most 0.25x the torch import;
`eps` and `noise`, which need dp-accounting and scipy, at most 0.75x.
`--json` also writes bench/results/cli_startup.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from orchestrator.cli.display import format_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "cli_startup.json"
# The main job (examples/mnist.toml): 3600 steps at q = 250/60000, sigma 1.3.
MAIN_JOB = ["--dataset-size", "60000", "--batch-size", "250", "--epochs", "15", "--delta", "1e-5"]
# (what the row shows, the dpfleet arguments or None for the torch import, the row's goal as a ratio to torch)
COMMANDS = [
    ("dpfleet --version", ["--version"], 0.25),
    ("dpfleet --help", ["--help"], 0.25),
    ("dpfleet ledger status --help", ["ledger", "status", "--help"], 0.25),
    ("dpfleet ledger status --json (a server on loopback)", ["ledger", "status", "--json"], 0.25),
    ("dpfleet eps (main job, pld)", ["eps", "--noise-multiplier", "1.3", *MAIN_JOB], 0.75),
    ("dpfleet noise (main job, pld)", ["noise", "--target-epsilon", "1", *MAIN_JOB], 0.75),
    ('python -c "import torch"', None, None),
]


def dpfleet() -> list[str]:
    """The `dpfleet` console script beside this Python, else `python -m orchestrator.cli` (the same program)."""
    script = Path(sys.executable).parent / "dpfleet"
    return [str(script)] if script.exists() else [sys.executable, "-m", "orchestrator.cli"]


def command_line(arguments: list[str] | None) -> list[str]:
    """The process a row runs."""
    return [sys.executable, "-c", "import torch"] if arguments is None else [*dpfleet(), *arguments]


def wall_seconds(command: list[str], environment: dict[str, str]) -> float:
    """The wall time of one run of ``command`` from the repository root; a failed run stops the benchmark."""
    began = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=environment)
    return time.perf_counter() - began


@contextlib.contextmanager
def ledger_server() -> Iterator[dict[str, str]]:
    """A `dpfleet ledger serve` on loopback with one dataset; the environment that points dpfleet at it."""
    with tempfile.TemporaryDirectory(prefix="dpfleet-cli-startup-") as folder:
        token = "admin-token-of-the-cli-startup-benchmark"
        environment = {**os.environ, "DPFLEET_ADMIN_TOKEN": token}
        server = subprocess.Popen([*dpfleet(), "ledger", "serve", "--db", f"{folder}/ledger.db", "--port", "0",
                                   "--allow-key-beside-database"],
                                  cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True)
        try:
            address = server.stdout.readline().removeprefix("listening on ").strip()
            environment = {**environment, "DPFLEET_LEDGER": address, "DPFLEET_TOKEN": token}
            for command in (["tenant", "create", "acme"],
                            ["dataset", "create", "acme/mnist", "--epsilon", "10", "--delta", "1e-5"]):
                subprocess.run([*dpfleet(), "ledger", *command], cwd=ROOT, env=environment, check=True,
                               stdout=subprocess.DEVNULL)
            yield environment
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)


def measure(rounds: int, environment: dict[str, str]) -> list[dict]:
    """One warm-up round, then ``rounds`` rounds of every command; each row's times, median and ratio to torch."""
    lines = [command_line(arguments) for _, arguments, _ in COMMANDS]
    for line in lines:
        wall_seconds(line, environment)
    times: list[list[float]] = [[] for _ in COMMANDS]
    for _ in range(rounds):
        for index, line in enumerate(lines):
            times[index].append(wall_seconds(line, environment))
    torch_median = statistics.median(times[-1])
    rows = []
    for (shown, arguments, goal), seconds in zip(COMMANDS, times):
        median = statistics.median(seconds)
        rows.append({"command": shown, "dpfleet_arguments": arguments, "median_seconds": median,
                     "ratio_to_torch_import": median / torch_median, "goal_ratio": goal,
                     "seconds": seconds})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Time the commands; print the table (and write the results with --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds after the warm-up (default 9)")
    parser.add_argument("--json", action="store_true", help="also write bench/results/cli_startup.json")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with ledger_server() as environment:
        rows = measure(args.rounds, environment)
    load_after = os.getloadavg()[0]
    print(format_table(
        ["command", "median wall (s)", "× import torch", "goal"],
        [[row["command"], f"{row['median_seconds']:.3f}", f"{row['ratio_to_torch_import']:.2f}",
          "" if row["goal_ratio"] is None else f"≤ {row['goal_ratio']:.2f}"] for row in rows],
    ))
    print(f"{args.rounds} rounds; 1-minute load average {load_before:.1f} before, {load_after:.1f} after")
    if args.json:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
        RESULTS.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": machine, "rounds": args.rounds,
            "load_average_before": load_before, "load_average_after": load_after, "results": rows,
        }, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
