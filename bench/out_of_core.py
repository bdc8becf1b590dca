"""Out-of-core training, side by side with in memory: `python -m bench.out_of_core [--rows N] [--json]`.

``--layout`` picks how the Parquet files are written: ``export`` (as
``dpfleet data export``: 16 rows a row group), ``pyarrow`` (pyarrow's default
row groups) or ``one-group`` (one row group a file, as Spark writes small
files). ``--plan-ahead K`` trains the Parquet side with ``plan_ahead_steps = K``
(batches planned K steps ahead and gathered by Ray Data). ``--model mlp``
trains a small MLP on 64 features instead of gdp_cnn on 784, and its
in-memory side holds the same synthetic rows in each worker's memory.

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
import pyarrow.parquet as pq
import ray
import torch

from orchestrator.config import build_config
from orchestrator.trainer import Trainer
from workers.sources import training_table, write_parquet_shards

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


MODELS = {"gdp_cnn": 784, "mlp": 64}
LAYOUTS = ("export", "pyarrow", "one-group")
_ROWS_VARIABLE = "DPFLEET_BENCH_ROWS"


def mlp_64() -> torch.nn.Module:
    """The MLP of the 64-feature runs: 64 -> 128 -> 10."""
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _synthetic_batches(rows: int, features: int, seed: int):
    rng = np.random.default_rng(seed)
    return ((rng.random((min(_WRITE_BATCH, rows - start), features), dtype=np.float32),
             rng.integers(0, 10, min(_WRITE_BATCH, rows - start))) for start in range(0, rows, _WRITE_BATCH))


def in_memory_64() -> tuple:
    """The MLP runs' in-memory side: the same synthetic rows as the Parquet files, held by each worker."""
    splits = []
    for seed, rows in ((0, int(os.environ[_ROWS_VARIABLE])), (1, TEST_ROWS)):
        features, labels = map(np.concatenate, zip(*_synthetic_batches(rows, 64, seed)))
        splits.append(torch.utils.data.TensorDataset(torch.from_numpy(features), torch.from_numpy(labels)))
    return tuple(splits)


def write_synthetic(directory: Path, rows: int, features: int = FEATURES, layout: str = "export") -> None:
    """Train (``rows``) and test (TEST_ROWS) splits of uniform [0, 1) features and uniform labels, streamed."""
    for seed, (split, count) in enumerate((("train", rows), ("test", TEST_ROWS))):
        batches = _synthetic_batches(count, features, seed)
        if layout == "export":
            write_parquet_shards(str(directory / split), batches, count, min(SHARDS, count))
            continue
        (directory / split).mkdir(parents=True)
        shards = min(SHARDS, count)
        bounds = [shard * count // shards for shard in range(shards + 1)]
        features_all, labels_all = map(np.concatenate, zip(*batches))
        for shard in range(shards):
            part = slice(bounds[shard], bounds[shard + 1])
            table = training_table(features_all[part], labels_all[part])
            # pyarrow's default row group (1Mi rows) or the whole file as one group.
            pq.write_table(table, directory / split / f"part-{shard:05d}.parquet", compression="none",
                           row_group_size=None if layout == "pyarrow" else len(table))


def measure(dataset, steps: int, batch_size: int, run_dir: Path, model: str = "gdp_cnn",
            plan_ahead: int | None = None) -> dict:
    """Train ``steps`` steps on ``dataset`` with 2 workers; return the step time and worker peak RSS."""
    config = build_config(dict(
        dataset=dataset, model="bench.out_of_core:mlp_64" if model == "mlp" else model, workers=2,
        cpus_per_worker=1, steps=steps, batch_size=batch_size,
        noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.1, seed=0, max_physical_batch=batch_size,
        test_subset=TEST_ROWS, run_dir=str(run_dir), **({"plan_ahead_steps": plan_ahead} if plan_ahead else {}),
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
    parser.add_argument("--model", choices=tuple(MODELS), default="gdp_cnn",
                        help="gdp_cnn on 784 features (default) or mlp on 64")
    parser.add_argument("--layout", choices=LAYOUTS, default="export", help="the Parquet files' row groups")
    parser.add_argument("--plan-ahead", type=int, default=None,
                        help="train the Parquet side with plan_ahead_steps = this (default: off)")
    parser.add_argument("--json", action="store_true", help="write bench/results/out_of_core.json")
    args = parser.parse_args(argv)
    features = MODELS[args.model]
    os.environ[_ROWS_VARIABLE] = str(args.rows)
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dpfleet-out-of-core-"))
    try:
        started = time.perf_counter()
        write_synthetic(directory, args.rows, features, args.layout)
        write_seconds = time.perf_counter() - started
        table = {"format": "parquet", "train": str(directory / "train"), "test": str(directory / "test"),
                 "features": "features", **({"shape": [1, 28, 28]} if args.model == "gdp_cnn" else {})}
        in_memory = "mnist" if args.model == "gdp_cnn" else "bench.out_of_core:in_memory_64"
        # "local": this benchmark's own Ray, even where another on the machine advertises itself.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        rounds = []
        try:
            for index in range(args.rounds):
                # Alternating order: on a shared machine, a load that changes over time falls on both sides.
                order = ("parquet", "mnist") if index % 2 == 0 else ("mnist", "parquet")
                measured = {side: measure(table if side == "parquet" else in_memory, args.steps, args.batch_size,
                                          directory / f"run-{side}-{index}", args.model,
                                          args.plan_ahead if side == "parquet" else None) for side in order}
                rounds.append(measured)
        finally:
            ray.shutdown()
        ratios = [measured["parquet"]["step_seconds"] / measured["mnist"]["step_seconds"] for measured in rounds]
        median_round = rounds[sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]]
        parquet, mnist = median_round["parquet"], median_round["mnist"]
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    data_bytes = args.rows * features * 4
    results = {
        "command": "python -m bench.out_of_core " + " ".join(argv),
        "rows": args.rows,
        "model": args.model,
        "layout": args.layout,
        "plan_ahead_steps": args.plan_ahead,
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
    print(f"{args.model}, layout {args.layout}, plan_ahead_steps {args.plan_ahead}")
    print(f"{'':26}{'Parquet (out of core)':>24}{'in memory':>20}")
    print(f"{'training rows':26}{args.rows:>24,}{mnist['dataset_size']:>20,}")
    print(f"{'peak worker RSS (GB)':26}{parquet['worker_peak_rss_gb_max']:>24.3f}{mnist['worker_peak_rss_gb_max']:>20.3f}")
    print(f"{'step time (ms)':26}{1000 * parquet['step_seconds']:>24.1f}{1000 * mnist['step_seconds']:>20.1f}")
    print(f"step time ratio (Parquet / in memory): {results['step_time_ratio']:.2f}, the median of "
          f"{', '.join(f'{ratio:.2f}' for ratio in ratios)}; "
          f"features on disk {data_bytes / 1e9:.2f} GB uncompressed")
    if args.json:
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "out_of_core.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
