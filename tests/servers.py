"""Servers that tests start on loopback themselves (the ledger as a real `dpfleet ledger serve` process, Ray
clusters of several nodes), and the tiny training job the tests run against them."""

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from accounting.accountants import get_accountant
from accounting.events import SampledGaussian
from orchestrator.trainer import ray_start_timed_out

REPOSITORY = Path(__file__).resolve().parents[1]
DPFLEET = [sys.executable, "-m", "orchestrator.cli"]
# A training job of a few seconds: 600 MNIST examples, expected batch 30 (q = 0.05), sigma 1.
TINY_JOB = """
dataset = "mnist"
model = "gdp_cnn"
workers = 2
batch_size = 30
train_subset = 600
test_subset = 200
noise_multiplier = 1.0
clip_norm = 1.0
learning_rate = 0.5
max_physical_batch = 64
"""


# Ray waits a fixed 30 s for a new node's raylet to register; a loaded 2-core machine can take longer.
NODE_START_ATTEMPTS = 3


def tiny_job_epsilon(steps: int) -> float:
    """The PLD epsilon at delta 1e-5 of `steps` steps of TINY_JOB."""
    return get_accountant("pld").epsilon(SampledGaussian(30 / 600, 1.0, steps), 1e-5)


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_serve_process(
    db_path: Path, token_file: Path, port: int = 0, extra_args: tuple[str, ...] = (), dpfleet: list[str] = DPFLEET
) -> tuple[subprocess.Popen, str]:
    """Start `dpfleet ledger serve` on 127.0.0.1:port (0: any free port); return it and its HOST:PORT.

    `extra_args` go to `serve` too; what it prints after its address is left to read on the process's stdout.
    The server keeps the default history key of the test's DPFLEET_HOME (--allow-key-beside-database).
    `dpfleet` is the command line that runs dpfleet.
    """
    process = subprocess.Popen(
        [*dpfleet, "ledger", "serve", "--db", str(db_path), "--port", str(port)]
        + ["--admin-token-file", str(token_file), "--allow-key-beside-database", *extra_args],
        cwd=REPOSITORY,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    match = re.fullmatch(r"listening on (127\.0\.0\.1:\d+)\n", line)
    if match is None:
        process.kill()
        pytest.fail(f"ledger serve printed {line!r}; stderr: {process.stderr.read()}")
    return process, match.group(1)


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A one-day certificate for localhost and 127.0.0.1 and its key (PEM files in `folder`), made by openssl."""
    certificate, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(certificate), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return certificate, key


def start_racers(commands: list[list[str]]) -> list[subprocess.Popen]:
    """Start one process per command, wait until each prints "ready", then release them all at once ("go")."""
    racers = [
        subprocess.Popen(command, cwd=REPOSITORY, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for command in commands
    ]
    for racer in racers:
        assert racer.stdout.readline() == "ready\n"
    for racer in racers:
        racer.stdin.write("go\n")
        racer.stdin.flush()
    return racers


def add_loopback_node(cluster: Cluster, **node_args) -> "ray._private.node.Node":
    """Add a node to `cluster` (its head if it has none), starting it afresh when it does not come up in time.

    The processes a timed-out start left behind are the test process's new children: they are killed, so the node
    is never counted twice. Each retry waits a little longer for the machine to calm down.
    """
    attempt = 1
    while True:
        earlier_children = {child.pid for child in psutil.Process().children()}
        try:
            return cluster.add_node(**node_args)
        except Exception as error:  # noqa: BLE001 - Ray's start-up errors have no class of their own
            if not ray_start_timed_out(error) or attempt == NODE_START_ATTEMPTS:
                raise
        for child in psutil.Process().children():
            if child.pid not in earlier_children:
                for process in [*child.children(recursive=True), child]:
                    process.kill()
        time.sleep(5.0 * attempt)
        attempt += 1


def start_loopback_cluster(nodes: list[dict]) -> tuple[Cluster, list["ray._private.node.Node"]]:
    """A Ray cluster on loopback with the driver connected: a head with no CPUs and a node per `nodes` entry.

    Each entry holds `add_node` arguments (num_cpus, resources); the head runs no dashboard. Stop it with
    `stop_loopback_cluster`.
    """
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster()
    add_loopback_node(cluster, num_cpus=0, include_dashboard=False)
    added = [add_loopback_node(cluster, **node_args) for node_args in nodes]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster, added


def stop_loopback_cluster(cluster: Cluster) -> None:
    """Disconnect the driver and stop every node of `cluster`."""
    ray.shutdown()
    cluster.shutdown()

