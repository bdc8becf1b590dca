"""The driver's own time per step from 2 to 16 gradient workers, on 4 loopback Ray nodes of 4 workers each.

    python -m bench.fan_in [--steps 20] [--batch-size 256] [--json]

A Ray cluster starts on this machine (`ray.cluster_utils.Cluster`: a head
with no CPUs and 4 nodes of 4 CPUs) and `gdp_cnn` (26k parameters) trains on
MNIST with 2, 4, 8 and 16 gradient workers of 1 CPU each, sampled by the
driver (no shards); Ray places the workers. Per step it records
(``bench.scaling.MeasuredTrainer``) the driver's own time (the step minus its
wait for the sums: what the workers wait for), its CPU time, its wait, the
slowest worker's time, and the partial-sum buffers and bytes the driver
received. The nodes' reducers add the sums of each node's workers there, so
the driver receives at most one buffer per node and sends one call per node:
its own time should stay flat as workers are added. All nodes share this
machine's cores, so the steps themselves slow down with more workers; only
the driver's share is the figure. `--json` writes bench/results/fan_in.json.
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
from datetime import datetime, timezone
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from bench.scaling import MeasuredTrainer
from orchestrator.config import build_config

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NODES, CPUS_PER_NODE = 4, 4
WORKER_COUNTS = (2, 4, 8, 16)
WARMUP_STEPS = 3


def measure(cluster_workers: int, steps: int, batch_size: int, run_root: Path) -> dict:
    """Train `steps` steps with `cluster_workers` workers on the running cluster; per-step rows and medians."""
    config = build_config(dict(
        dataset="mnist", model="gdp_cnn", workers=cluster_workers, steps=steps, batch_size=batch_size,
        noise_multiplier=1.0, test_subset=100, max_physical_batch=batch_size,
        run_dir=str(run_root / f"workers-{cluster_workers}"),
    ))
    trainer = MeasuredTrainer(config, show_progress=False, out=io.StringIO())
    trainer.run()
    timed = trainer.rows[WARMUP_STEPS:]
    placement: dict[str, int] = {}
    for node in trainer.worker_nodes.values():
        placement[node] = placement.get(node, 0) + 1

    def median(key):
        return statistics.median(row[key] for row in timed)

    return {
        "workers": cluster_workers,
        "workers_per_node": sorted(placement.values(), reverse=True),
        "median_after_warmup": {key: median(key) for key in (
            "driver_wall_s", "driver_own_s", "driver_cpu_s", "worker_s_slowest", "buffers_in", "bytes_in",
            "bytes_out")},
        "steps": trainer.rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure every worker count on one cluster, print a table, and with --json write bench/results/fan_in.json."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="write bench/results/fan_in.json")
    args = parser.parse_args(argv)
    # Ray starts workers at niceness 15; keep them on the driver's terms on a shared machine.
    os.environ["RAY_worker_niceness"] = str(os.nice(0))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(NODES):
        cluster.add_node(num_cpus=CPUS_PER_NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    results = []
    try:
        with tempfile.TemporaryDirectory() as run_root:
            for workers in WORKER_COUNTS:
                results.append(measure(workers, args.steps, args.batch_size, Path(run_root)))
                row = results[-1]["median_after_warmup"]
                print(f"{workers:2d} workers {results[-1]['workers_per_node']}: "
                      f"step {row['driver_wall_s'] * 1e3:.1f} ms, "
                      f"driver's own {row['driver_own_s'] * 1e3:.2f} ms (cpu {row['driver_cpu_s'] * 1e3:.2f} ms), "
                      f"{row['buffers_in']:.0f} buffers in ({row['bytes_in'] / 1e3:.0f} kB), slowest worker "
                      f"{row['worker_s_slowest'] * 1e3:.1f} ms", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    growth = (results[-1]["median_after_warmup"]["driver_own_s"] / results[0]["median_after_warmup"]["driver_own_s"])
    print(f"driver's own time per step, {WORKER_COUNTS[-1]} workers against {WORKER_COUNTS[0]}: {growth:.2f}x")
    if args.json:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / "fan_in.json").write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "load_average": os.getloadavg(),
            "command": "python -m bench.fan_in " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": "gdp_cnn", "dataset": "mnist", "batch_size": args.batch_size, "warmup_steps": WARMUP_STEPS,
            "nodes": NODES, "cpus_per_node": CPUS_PER_NODE,
            "driver_own_growth": growth,
            "runs": results,
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
