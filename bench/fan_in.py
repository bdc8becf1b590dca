"""The driver's own time per step from 2 to 16 gradient workers, up to 4 loopback Ray nodes of 4 workers each.

    python -m bench.fan_in [--steps 20] [--batch-size 256] [--json]

For each layout (nodes x workers per node: 2 x 1, 4 x 1, 4 x 2, 4 x 4) a Ray
cluster starts on this machine (`ray.cluster_utils.Cluster`: a head with no
CPUs and one node per worker group, with a CPU per worker, so the workers
fill every node alike) and `gdp_cnn` (26k parameters) trains on MNIST with
gradient workers of 1 CPU each, sampled by the driver (no shards). Per step it records
(``bench.scaling.MeasuredTrainer``) the driver's own time (the step minus its
wait for the sums: what the workers wait for), its CPU time, its wait, the
slowest worker's time, and the partial-sum buffers and bytes the driver
received. The nodes' reducers add the sums of each node's workers there, so
the driver receives one buffer per node and sends one call per node: its own
time grows with the nodes, not with the workers on them. All nodes share this
machine's cores, so the steps themselves slow down with more workers; only
the driver's share is the figure. `--json` writes bench/results/fan_in.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench.scaling import RESULTS_DIR, medians_after_warmup, results_header, train_on_cluster

LAYOUTS = ((2, 1), (4, 1), (4, 2), (4, 4))  # (nodes, workers per node)


def measure(nodes: int, workers_per_node: int, steps: int, batch_size: int, run_root: Path) -> dict:
    """Train `steps` steps on a fresh cluster of `nodes` nodes of `workers_per_node` workers; rows and medians."""
    cluster_workers = nodes * workers_per_node
    trainer = train_on_cluster([{"num_cpus": workers_per_node}] * nodes, dict(
        dataset="mnist", model="gdp_cnn", workers=cluster_workers, steps=steps, batch_size=batch_size,
        noise_multiplier=1.0, test_subset=100, max_physical_batch=batch_size,
        run_dir=str(run_root / f"workers-{cluster_workers}"),
    ))
    placement: dict[str, int] = {}
    for node in trainer.fleet.worker_nodes.values():
        placement[node] = placement.get(node, 0) + 1
    return {
        "nodes": nodes,
        "workers": cluster_workers,
        "workers_per_node": sorted(placement.values(), reverse=True),
        "median_after_warmup": medians_after_warmup(trainer.rows, (
            "driver_wall_s", "driver_own_s", "driver_cpu_s", "worker_s_slowest", "buffers_in", "bytes_in",
            "bytes_out")),
        "steps": trainer.rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure every layout, print a table, and with --json write bench/results/fan_in.json."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="write bench/results/fan_in.json")
    args = parser.parse_args(argv)
    # Ray starts workers at niceness 15; keep them on the driver's terms on a shared machine.
    os.environ["RAY_worker_niceness"] = str(os.nice(0))
    results = []
    with tempfile.TemporaryDirectory() as run_root:
        for nodes, workers_per_node in LAYOUTS:
            results.append(measure(nodes, workers_per_node, args.steps, args.batch_size, Path(run_root)))
            row = results[-1]["median_after_warmup"]
            print(f"{nodes} nodes x {workers_per_node} workers {results[-1]['workers_per_node']}: "
                  f"step {row['driver_wall_s'] * 1e3:.1f} ms, "
                  f"driver's own {row['driver_own_s'] * 1e3:.2f} ms (cpu {row['driver_cpu_s'] * 1e3:.2f} ms), "
                  f"{row['buffers_in']:.0f} buffers in ({row['bytes_in'] / 1e3:.0f} kB), slowest worker "
                  f"{row['worker_s_slowest'] * 1e3:.1f} ms", flush=True)
    first, last = results[0]["median_after_warmup"], results[-1]["median_after_warmup"]
    growth = {key: last[key] / first[key] for key in ("driver_own_s", "driver_cpu_s")}
    print(f"{results[-1]['workers']} workers against {results[0]['workers']}: driver's own time per step "
          f"{growth['driver_own_s']:.2f}x, its CPU time {growth['driver_cpu_s']:.2f}x")
    if args.json:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / "fan_in.json").write_text(json.dumps({
            **results_header("bench.fan_in", argv, args.batch_size),
            "growth_first_to_last": growth,
            "runs": results,
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
