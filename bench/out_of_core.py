"""Out-of-core training, side by side with in-memory MNIST: `python -m bench.out_of_core [--rows N] [--json]`.

Writes a synthetic Parquet dataset (``--rows`` rows of 784 float32 features,
shaped 1x28x28, and a label in 0..9; 2,000,000 rows, about 6 GB, by
default) with ``workers.sources.write_parquet_shards``, then trains gdp_cnn on
it with 2 gradient workers of 1 thread for ``--steps`` steps, and does the same
on the built-in MNIST (held in memory by each worker) at the same expected
batch size, ``--rounds`` times in alternating order. For the round with the
median step-time ratio it reports the peak resident set of each worker
process (VmHWM, read from /proc after training) and the wall time per step
(training steps only, evaluation excluded). ``--json`` writes the figures to
bench/results/out_of_core.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

from orchestrator.config import build_config
from orchestrator.trainer import Trainer
from workers.sources import write_parquet_shards

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FEATURES = 784
TEST_ROWS = 1000
SHARDS = 8
_WRITE_BATCH = 20_000


class MeasuredTrainer(Trainer):
    """A Trainer that times its training steps and reads its workers' peak resident sets afterwards."""

    def _train(self, workers: list) -> None:
        pids = [int(identity.rsplit(":", 1)[1]) for identity in ray.get([w.ping.remote() for w in workers])]
        evaluation_seconds = 0.0
        record_epoch = self._record_epoch

        def timed_record_epoch(*args):
            nonlocal evaluation_seconds
            started = time.perf_counter()
            record_epoch(*args)
            evaluation_seconds += time.perf_counter() - started

        self._record_epoch = timed_record_epoch
        started = time.perf_counter()
        super()._train(workers)
        self.step_seconds = (time.perf_counter() - started - evaluation_seconds) / self.plan.steps
        self.worker_peak_rss_bytes = [_peak_rss_bytes(pid) for pid in pids]


def _peak_rss_bytes(pid: int) -> int:
    """VmHWM of a live process: the most resident memory it ever held."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM line")


def write_synthetic(directory: Path, rows: int, seed: int = 0) -> None:
    """Train (``rows``) and test (TEST_ROWS) splits of uniform [0, 1) features and uniform labels, streamed."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", rows), ("test", TEST_ROWS)):
        batches = ((rng.random((min(_WRITE_BATCH, count - start), FEATURES), dtype=np.float32),
                    rng.integers(0, 10, min(_WRITE_BATCH, count - start)))
                   for start in range(0, count, _WRITE_BATCH))
        write_parquet_shards(str(directory / split), batches, count, min(SHARDS, count))


def measure(dataset, steps: int, batch_size: int, run_dir: Path) -> dict:
    """Train ``steps`` steps on ``dataset`` with 2 workers; return the step time and worker peak RSS."""
    config = build_config(dict(
        dataset=dataset, model="gdp_cnn", workers=2, cpus_per_worker=1, steps=steps, batch_size=batch_size,
        noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.1, seed=0, max_physical_batch=batch_size,
        test_subset=TEST_ROWS, run_dir=str(run_dir),
    ))
    trainer = MeasuredTrainer(config, show_progress=False, out=open(os.devnull, "w"))
    trainer.run()
    return {
        "dataset_size": trainer.plan.dataset_size,
        "step_seconds": trainer.step_seconds,
        "worker_peak_rss_bytes": trainer.worker_peak_rss_bytes,
        "worker_peak_rss_gb_max": max(trainer.worker_peak_rss_bytes) / 1e9,
    }


def main(argv: list[str]) -> int:
    """Write the dataset, train on it and on MNIST, print (and with --json save) the comparison."""
    parser = argparse.ArgumentParser(prog="python -m bench.out_of_core", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="training rows to write (default 2,000,000)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--batch-size", type=int, default=250, help="expected batch size (default 250)")
    parser.add_argument("--dir", help="where to write the dataset (default: a temporary directory, removed after)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="Parquet/MNIST pairs, in alternating order; the median pair is reported (default 3)")
    parser.add_argument("--json", action="store_true", help="write bench/results/out_of_core.json")
    args = parser.parse_args(argv)
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dpfleet-out-of-core-"))
    try:
        started = time.perf_counter()
        write_synthetic(directory, args.rows)
        write_seconds = time.perf_counter() - started
        table = {"format": "parquet", "train": str(directory / "train"), "test": str(directory / "test"),
                 "shape": [1, 28, 28], "features": "features"}
        # "local": this benchmark's own Ray, even where another on the machine advertises itself.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        rounds = []
        try:
            for index in range(args.rounds):
                # Alternating order: on a shared machine, a load that changes over time falls on both sides.
                order = ("parquet", "mnist") if index % 2 == 0 else ("mnist", "parquet")
                measured = {side: measure(table if side == "parquet" else "mnist", args.steps, args.batch_size,
                                          directory / f"run-{side}-{index}") for side in order}
                rounds.append(measured)
        finally:
            ray.shutdown()
        ratios = [measured["parquet"]["step_seconds"] / measured["mnist"]["step_seconds"] for measured in rounds]
        median_round = rounds[sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]]
        parquet, mnist = median_round["parquet"], median_round["mnist"]
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    data_bytes = args.rows * FEATURES * 4
    results = {
        "command": "python -m bench.out_of_core " + " ".join(argv),
        "rows": args.rows,
        "feature_bytes": data_bytes,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "workers": 2,
        "write_seconds": write_seconds,
        "parquet": parquet,
        "mnist_in_memory": mnist,
        "step_time_ratio": parquet["step_seconds"] / mnist["step_seconds"],
        "step_time_ratios_by_round": ratios,
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
    }
    print(f"{'':26}{'Parquet (out of core)':>24}{'MNIST (in memory)':>20}")
    print(f"{'training rows':26}{args.rows:>24,}{mnist['dataset_size']:>20,}")
    print(f"{'peak worker RSS (GB)':26}{parquet['worker_peak_rss_gb_max']:>24.3f}{mnist['worker_peak_rss_gb_max']:>20.3f}")
    print(f"{'step time (ms)':26}{1000 * parquet['step_seconds']:>24.1f}{1000 * mnist['step_seconds']:>20.1f}")
    print(f"step time ratio (Parquet / MNIST): {results['step_time_ratio']:.2f}, the median of "
          f"{', '.join(f'{ratio:.2f}' for ratio in ratios)}; "
          f"features on disk {data_bytes / 1e9:.2f} GB uncompressed")
    if args.json:
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "out_of_core.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
