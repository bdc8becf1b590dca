"""How fast the command line answers, beside a bare `import torch`: `python -m bench.cli_startup [--json]`.

Each command runs as a new process, as a user or a cron job runs it, in
rounds: one warm-up round (to fill the page cache), then ``--rounds`` rounds,
each running every command once in turn, so that a change in the machine's
load touches every command alike. The table gives each command's median wall
time and its ratio to the median of `python -c "import torch"`. `ledger
status --json` asks a `dpfleet ledger serve` that the benchmark starts on
loopback (as a cron job or an exporter asks a ledger server). The goals:
`--help`, `--version` and the ledger commands at most 0.25x the torch import;
`eps` and `noise`, which need dp-accounting and scipy, at most 0.75x. Two
newcomer's mistakes that `dpfleet train` refuses (exit status 2) are timed
too, each under 3 s: a misspelt config key, refused before torch loads, and a
model whose first layer does not fit MNIST's 784 values, refused by the dry
run before Ray loads or the ledger is asked (their files are written to a
temporary folder). `--json` also writes bench/results/cli_startup.json.
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
import textwrap
import time
from pathlib import Path
from typing import Iterator, NamedTuple

from orchestrator.cli.display import format_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "cli_startup.json"
# The main job (examples/mnist.toml): 3600 steps at q = 250/60000, sigma 1.3.
MAIN_JOB = ["--dataset-size", "60000", "--batch-size", "250", "--epochs", "15", "--delta", "1e-5"]
# The mistakes' files (`mistakes_folder`): a model module, and a job on MNIST with it.
MISFIT_MODEL = '''
from torch import nn


def build():
    return nn.Sequential(nn.Flatten(), nn.Linear(100, 10))
'''
MISFIT_JOB = '''
model = "misfit_model:build"
dataset = "mnist"
workers = 1
steps = 2
batch_size = 10
noise_multiplier = 1.0
learning_rate = 0.1
data_root = "{folder}/no-data"
run_dir = "{folder}/run"
'''


class Command(NamedTuple):
    """A row: what it shows, the dpfleet arguments (None for the torch import), its goal as a ratio to the torch
    import or in seconds, and the exit status it must end with."""

    shown: str
    arguments: list[str] | None
    goal_ratio: float | None = None
    goal_seconds: float | None = None
    status: int = 0


# {mistakes} in an argument is the folder of the mistakes' files.
COMMANDS = [
    Command("dpfleet --version", ["--version"], 0.25),
    Command("dpfleet --help", ["--help"], 0.25),
    Command("dpfleet ledger status --help", ["ledger", "status", "--help"], 0.25),
    Command("dpfleet ledger status --json (a server on loopback)", ["ledger", "status", "--json"], 0.25),
    Command("dpfleet eps (main job, pld)", ["eps", "--noise-multiplier", "1.3", *MAIN_JOB], 0.75),
    Command("dpfleet noise (main job, pld)", ["noise", "--target-epsilon", "1", *MAIN_JOB], 0.75),
    Command("dpfleet train, a misspelt key (refused)", ["train", "--config", "{mistakes}/misspelt.toml"],
            goal_seconds=3.0, status=2),
    Command("dpfleet train, a model that does not fit MNIST (refused)",
            ["train", "--config", "{mistakes}/misfit.toml"], goal_seconds=3.0, status=2),
    Command('python -c "import torch"', None),
]


def dpfleet() -> list[str]:
    """The `dpfleet` console script beside this Python, else `python -m orchestrator.cli` (the same program)."""
    script = Path(sys.executable).parent / "dpfleet"
    return [str(script)] if script.exists() else [sys.executable, "-m", "orchestrator.cli"]


def command_line(arguments: list[str] | None, mistakes: str) -> list[str]:
    """The process a row runs (the mistakes' files in the folder ``mistakes``)."""
    if arguments is None:
        return [sys.executable, "-c", "import torch"]
    return [*dpfleet(), *(word.format(mistakes=mistakes) for word in arguments)]


def wall_seconds(command: list[str], environment: dict[str, str], status: int = 0) -> float:
    """The wall time of one run of ``command`` from the repository root; a run that does not end with ``status``
    stops the benchmark."""
    began = time.perf_counter()
    completed = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=environment, text=True)
    seconds = time.perf_counter() - began
    if completed.returncode != status:
        raise RuntimeError(f"{' '.join(command)} exited with status {completed.returncode}, not {status}: "
                           f"{completed.stderr.strip()}")
    return seconds


@contextlib.contextmanager
def mistakes_folder() -> Iterator[str]:
    """A temporary folder holding the mistakes' files: a config with a misspelt key, and a job on MNIST whose
    model (beside it) takes 100 values."""
    with tempfile.TemporaryDirectory(prefix="dpfleet-cli-mistakes-") as folder:
        job = textwrap.dedent(MISFIT_JOB).format(folder=folder).lstrip()
        Path(folder, "misfit_model.py").write_text(textwrap.dedent(MISFIT_MODEL).lstrip())
        Path(folder, "misfit.toml").write_text(job)
        Path(folder, "misspelt.toml").write_text(job.replace("steps", "stepz"))
        yield folder


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


def measure(rounds: int, environment: dict[str, str], mistakes: str) -> list[dict]:
    """One warm-up round, then ``rounds`` rounds of every command; each row's times, median and ratio to torch."""
    lines = [command_line(command.arguments, mistakes) for command in COMMANDS]
    for command, line in zip(COMMANDS, lines):
        wall_seconds(line, environment, command.status)
    times: list[list[float]] = [[] for _ in COMMANDS]
    for _ in range(rounds):
        for index, (command, line) in enumerate(zip(COMMANDS, lines)):
            times[index].append(wall_seconds(line, environment, command.status))
    torch_median = statistics.median(times[-1])
    rows = []
    for command, seconds in zip(COMMANDS, times):
        median = statistics.median(seconds)
        rows.append({"command": command.shown, "dpfleet_arguments": command.arguments, "median_seconds": median,
                     "ratio_to_torch_import": median / torch_median, "goal_ratio": command.goal_ratio,
                     "goal_seconds": command.goal_seconds, "seconds": seconds})
    return rows


def goal_text(row: dict) -> str:
    """A row's goal as the table shows it: a ratio to the torch import, or seconds."""
    if row["goal_ratio"] is not None:
        return f"≤ {row['goal_ratio']:.2f}"
    return "" if row["goal_seconds"] is None else f"≤ {row['goal_seconds']:g} s"


def main(argv: list[str] | None = None) -> int:
    """Time the commands; print the table (and write the results with --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds after the warm-up (default 9)")
    parser.add_argument("--json", action="store_true", help="also write bench/results/cli_startup.json")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with ledger_server() as environment, mistakes_folder() as mistakes:
        rows = measure(args.rounds, environment, mistakes)
    load_after = os.getloadavg()[0]
    print(format_table(
        ["command", "median wall (s)", "× import torch", "goal"],
        [[row["command"], f"{row['median_seconds']:.3f}", f"{row['ratio_to_torch_import']:.2f}", goal_text(row)]
         for row in rows],
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
