"""Sharded training on 1, 2 and 4 Ray nodes on loopback: what each step costs the driver and the workers.

    python -m bench.scaling [--steps 30] [--batch-size 256] [--json]
    python -m bench.scaling --paths [--models bench.mlp:mlp_1m ...] [--workers 1 2] [--aggregations driver
        collective] [--json [NAME]]

For each node count, a Ray cluster starts on this machine (`ray.cluster_utils.
Cluster`: a head with no CPUs, one 1-CPU node per silo with its own custom
resource) and `gdp_cnn` trains on MNIST split into one shard per node. Per step
it records the driver's wall time, the part of it the driver spends on its own
(the step minus the time it waits for the workers' sums), the driver thread's
CPU time, the bytes the driver sends (one copy of the flat float32 weights per
worker node: Ray ships the object once per node) and receives (the sums,
measured), and the slowest worker's time inside its sampled clipped sum. All nodes
share this machine's cores, so more nodes here means contention, not speed:
the figures show what the driver's share of a step is, and that its traffic
grows with the node count and not with N. `--json` writes
bench/results/scaling.json.

With `--paths`, each `bench.mlp` model trains on 1, 2, ... one-CPU loopback
nodes, one worker each, on the driver path and then the collective path
(`aggregation`), side by side: the step, the driver's own time, its process's
CPU seconds (so that work on its other threads shows), the bytes it moved
(`driver_bytes_per_step`, counted) and the slowest worker's time. `--json`
writes bench/results/paths.json (`--json NAME`: bench/results/NAME.json);
`--aggregations collective` runs one path only (the 100M run).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from orchestrator.config import build_config
from orchestrator.trainer import Trainer

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NODE_COUNTS = (1, 2, 4)
WARMUP_STEPS = 3


class MeasuredTrainer(Trainer):
    """A trainer that keeps, per step, its breakdown (``Trainer.record.times``), CPU time and traffic."""

    def __init__(self, *args, **kwargs):
        self.rows: list[dict] = []
        super().__init__(*args, **kwargs)

    def _step(self, workers):
        before, cpu, process_cpu = self.record.times, time.thread_time(), time.process_time()
        super()._step(workers)
        cpu, step = time.thread_time() - cpu, self.record.times.minus(before)
        collective = self.aggregation == "collective"
        weights_bytes = 4 * self.flat_weights.numel()
        nodes = (0 if collective else len(set(self.shards.nodes.values()) if self.shards
                                          else set(self.fleet.worker_nodes.values())))
        self.rows.append({
            "step": self.step, "driver_wall_s": step.driver + step.wait, "driver_own_s": step.driver,
            "driver_cpu_s": cpu, "driver_process_cpu_s": time.process_time() - process_cpu,
            "bytes_out": weights_bytes * nodes, "driver_bytes": step.driver_bytes,
            "bytes_in": 0 if collective else sum(part.nbytes for part in self.gathered.parts),
            "buffers_in": 0 if collective else len(self.gathered.parts), "worker_s_slowest": step.worker,
        })


def train_on_cluster(node_resources: list[dict], config_values: dict) -> MeasuredTrainer:
    """Train `config_values` on a fresh loopback cluster: a head with no CPUs and one node per `add_node` kwargs."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for node in node_resources:
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        trainer = MeasuredTrainer(build_config(config_values), show_progress=False, out=io.StringIO())
        trainer.summary = trainer.run()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return trainer


def medians_after_warmup(rows: list[dict], keys: tuple[str, ...]) -> dict:
    """Each of `keys`' median over the per-step `rows` after the first WARMUP_STEPS."""
    return {key: statistics.median(row[key] for row in rows[WARMUP_STEPS:]) for key in keys}


def results_header(command: str, argv: list[str] | None, batch_size: int) -> dict:
    """The date, machine, load and command a results file starts with."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "load_average": os.getloadavg(),
        "command": f"python -m {command} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": "gdp_cnn", "dataset": "mnist", "batch_size": batch_size, "warmup_steps": WARMUP_STEPS,
    }


def measure(nodes: int, steps: int, batch_size: int, run_root: Path) -> dict:
    """Train `steps` steps on `nodes` silo nodes; return the per-step rows and their medians after warm-up."""
    silos = [f"silo-{index}" for index in range(nodes)]
    trainer = train_on_cluster([{"num_cpus": 1, "resources": {silo: 1}} for silo in silos], dict(
        model="gdp_cnn", steps=steps, batch_size=batch_size, noise_multiplier=1.0, test_subset=100,
        max_physical_batch=batch_size, run_dir=str(run_root / f"nodes-{nodes}"),
        shards=[{"dataset": "mnist", "part": part, "parts": nodes, "resources": {silo: 1}}
                for part, silo in enumerate(silos)],
    ))
    return {
        "nodes": nodes,
        "median_after_warmup": medians_after_warmup(trainer.rows, (
            "driver_wall_s", "driver_own_s", "driver_cpu_s", "bytes_out", "bytes_in", "worker_s_slowest")),
        "steps": trainer.rows,
    }


PATH_KEYS = ("driver_wall_s", "driver_own_s", "driver_process_cpu_s", "driver_bytes", "worker_s_slowest")


def compare_paths(model: str, workers: int, steps: int, batch_size: int, run_root: Path,
                  aggregations: tuple[str, ...] = ("driver", "collective")) -> list[dict]:
    """`model` on `workers` one-CPU loopback nodes, on each of `aggregations` in turn; per-step rows and medians."""
    rows = []
    for aggregation in aggregations:
        trainer = train_on_cluster([{"num_cpus": 1} for _ in range(workers)], dict(
            dataset="mnist", model=model, workers=workers, aggregation=aggregation, steps=steps,
            batch_size=batch_size, train_subset=6000, test_subset=100, noise_multiplier=1.0,
            max_physical_batch=batch_size, run_dir=str(run_root / f"{aggregation}-{workers}-{model}"),
        ))
        rows.append({"model": model, "parameters": trainer.flat_weights.numel(), "workers": workers,
                     "aggregation": aggregation, "median_after_warmup": medians_after_warmup(trainer.rows, PATH_KEYS),
                     "driver_bytes_per_step": trainer.record.times.driver_bytes_per_step(),
                     "load_average_after": os.getloadavg(), "steps": trainer.rows})
    return rows


def print_path_row(row: dict) -> None:
    """One line of `compare_paths`'s table."""
    median = row["median_after_warmup"]
    print(f"{row['parameters'] / 1e6:.2f}M params, {row['workers']} worker(s), {row['aggregation']:>10}: step "
          f"{median['driver_wall_s'] * 1e3:.1f} ms, driver's own {median['driver_own_s'] * 1e3:.2f} ms, driver "
          f"process cpu {median['driver_process_cpu_s'] * 1e3:.1f} ms, driver bytes {median['driver_bytes']:.0f}, "
          f"slowest worker {median['worker_s_slowest'] * 1e3:.1f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Measure every node count (or with --paths, driver against collective), print a table; --json writes it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--paths", action="store_true",
                        help="driver path against collective path on bench.mlp models (--models, --workers)")
    parser.add_argument("--models", nargs="+", default=["bench.mlp:mlp_1m"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--aggregations", nargs="+", default=["driver", "collective"],
                        choices=["driver", "collective"], help="the paths --paths runs, in this order")
    parser.add_argument("--json", nargs="?", const="", default=None, metavar="NAME",
                        help="write bench/results/scaling.json (paths.json; NAME.json when given)")
    args = parser.parse_args(argv)
    # Ray starts workers at niceness 15; keep them on the driver's terms on a shared machine.
    os.environ["RAY_worker_niceness"] = str(os.nice(0))
    results = []

    def write_results() -> None:
        # After each row, so that a long run stopped midway keeps the rows it measured.
        if args.json is None:
            return
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        name = args.json or ("paths" if args.paths else "scaling")
        (RESULTS_DIR / f"{name}.json").write_text(json.dumps({
            **results_header("bench.scaling", argv, args.batch_size),
            **({"model": args.models, "dataset": "mnist"} if args.paths else {}), "runs": results,
        }, indent=2))

    with tempfile.TemporaryDirectory() as run_root:
        if args.paths:
            for model in args.models:
                for workers in args.workers:
                    for row in compare_paths(model, workers, args.steps, args.batch_size, Path(run_root),
                                             tuple(args.aggregations)):
                        results.append(row)
                        print_path_row(row)
                        write_results()
        for nodes in () if args.paths else NODE_COUNTS:
            results.append(measure(nodes, args.steps, args.batch_size, Path(run_root)))
            write_results()
            row = results[-1]["median_after_warmup"]
            print(f"{nodes} node(s): step {row['driver_wall_s'] * 1e3:.1f} ms, driver's own "
                  f"{row['driver_own_s'] * 1e3:.2f} ms (cpu {row['driver_cpu_s'] * 1e3:.2f} ms), out "
                  f"{row['bytes_out'] / 1e3:.0f} kB, in {row['bytes_in'] / 1e3:.0f} kB, slowest worker "
                  f"{row['worker_s_slowest'] * 1e3:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
