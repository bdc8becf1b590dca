"""Out-of-core training, side by side with in memory: `python -m bench.out_of_core [--rows N ...] [--json]`.

For each model (``--model``: gdp_cnn on 784 float32 features shaped 1x28x28,
or an MLP on 64), each layout (``--layout``: ``export`` as ``dpfleet data
export`` writes it, 16 rows a row group; ``pyarrow``, pyarrow's default row
groups of up to 1Mi rows; ``spark``, one large row group a file) and each
size (``--rows``), it writes a synthetic Parquet dataset of 8 files (uniform
[0, 1) features, labels in 0..9), trains on it with 2 gradient workers of 1
thread for ``--steps`` steps, and trains the same model held in memory at the
same expected batch size: gdp_cnn on the built-in MNIST, the MLP on the same
synthetic rows (at most ``--memory-rows`` of them, so that two workers' copies
fit the machine). The two sides run ``--rounds`` times in alternating order;
the round with the median step-time ratio is reported. The Parquet side
trains as a config without ``plan_ahead_steps`` does (batches planned ahead,
``auto``); ``--plan-ahead K`` (``auto``, or ``off``: the workers read row
groups step by step) sets the key. The dataset is deleted after its runs
unless ``--dir`` keeps it.

Peak RSS is each worker process's VmHWM, read from /proc after training.
The step time is the mean wall time of the steps after the first (the
first waits for the first window's gather, which starts with the workers,
and is reported apart as ``first_step_seconds``); evaluation is excluded.
``--json`` writes every figure, with the date, machine, command and the
load averages before and after, to bench/results/out_of_core-MODELS.json (MODELS: the
``--model`` names joined by -), or to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
    """A Trainer that times each training step and reads its workers' peak resident sets afterwards."""

    def _train(self, workers: list) -> None:
        pids = [int(identity.rsplit(":", 1)[1]) for identity in ray.get([w.ping.remote() for w in workers])]
        self.step_durations = []
        step = self._step

        def timed_step(*args):
            started = time.perf_counter()
            step(*args)
            self.step_durations.append(time.perf_counter() - started)

        self._step = timed_step
        super()._train(workers)
        self.worker_peak_rss_bytes = [_peak_rss_bytes(pid) for pid in pids]


def _peak_rss_bytes(pid: int) -> int:
    """VmHWM of a live process: the most resident memory it ever held."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM line")


MODELS = {"gdp_cnn": 784, "mlp": 64}
LAYOUTS = ("export", "pyarrow", "spark")
# The most rows the MLP's in-memory side holds (each of 2 workers a copy): 20M rows of 64 float32 would be 5 GB each.
MEMORY_ROWS = 2_000_000
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
    """Train (``rows``) and test (TEST_ROWS) splits of uniform [0, 1) features and uniform labels, 8 files each.

    ``export`` streams through ``write_parquet_shards``; ``pyarrow`` and
    ``spark`` hold one file's rows at a time.
    """
    for seed, (split, count) in enumerate((("train", rows), ("test", TEST_ROWS))):
        batches = _synthetic_batches(count, features, seed)
        if layout == "export":
            write_parquet_shards(str(directory / split), batches, count, min(SHARDS, count))
            continue
        (directory / split).mkdir(parents=True)
        shards = min(SHARDS, count)
        bounds = [shard * count // shards for shard in range(shards + 1)]
        pending_features, pending_labels = [], []
        for shard in range(shards):
            wanted = bounds[shard + 1] - bounds[shard]
            while sum(map(len, pending_labels)) < wanted:
                batch_features, batch_labels = next(batches)
                pending_features.append(batch_features)
                pending_labels.append(batch_labels)
            features_all, labels_all = np.concatenate(pending_features), np.concatenate(pending_labels)
            pending_features, pending_labels = [features_all[wanted:]], [labels_all[wanted:]]
            table = training_table(features_all[:wanted], labels_all[:wanted])
            # pyarrow's default row group (1Mi rows) or the whole file as one group, as Spark writes a small file.
            pq.write_table(table, directory / split / f"part-{shard:05d}.parquet", compression="none",
                           row_group_size=None if layout == "pyarrow" else len(table))
            del table, features_all, labels_all


def measure(dataset, steps: int, batch_size: int, run_dir: Path, model: str = "gdp_cnn",
            plan_ahead: int | str | None = None) -> dict:
    """Train ``steps`` steps on ``dataset`` with 2 workers; return the step time and worker peak RSS.

    ``plan_ahead`` is the config's ``plan_ahead_steps``, left out when None.
    """
    config = build_config(dict(
        dataset=dataset, model="bench.out_of_core:mlp_64" if model == "mlp" else model, workers=2,
        cpus_per_worker=1, steps=steps, batch_size=batch_size,
        noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.1, seed=0, max_physical_batch=batch_size,
        test_subset=TEST_ROWS, run_dir=str(run_dir),
        **({"plan_ahead_steps": plan_ahead} if plan_ahead is not None else {}),
    ))
    trainer = MeasuredTrainer(config, show_progress=False, out=open(os.devnull, "w"))
    trainer.run()
    durations = trainer.step_durations
    return {
        "dataset_size": trainer.plan.dataset_size,
        # The steps the batches were planned ahead ("auto" or a number), or None: rows read one by one.
        "planned_steps": trainer.planned_steps,
        "step_seconds": float(np.mean(durations[1:])),
        "first_step_seconds": durations[0],
        "worker_peak_rss_bytes": trainer.worker_peak_rss_bytes,
        "worker_peak_rss_gb_max": max(trainer.worker_peak_rss_bytes) / 1e9,
    }


def _plan_ahead(value: str) -> int | str:
    return value if value in ("auto", "off") else int(value)


def compare(directory: Path, rows: int, model: str, layout: str, args) -> dict:
    """Write one dataset, train on it and in memory in alternating rounds; the median round's figures."""
    features = MODELS[model]
    memory_rows = min(rows, args.memory_rows)
    os.environ[_ROWS_VARIABLE] = str(memory_rows)
    started = time.perf_counter()
    write_synthetic(directory, rows, features, layout)
    write_seconds = time.perf_counter() - started
    table = {"format": "parquet", "train": str(directory / "train"), "test": str(directory / "test"),
             "features": "features", **({"shape": [1, 28, 28]} if model == "gdp_cnn" else {})}
    in_memory = "mnist" if model == "gdp_cnn" else "bench.out_of_core:in_memory_64"
    rounds = []
    # A Ray of this comparison's own: its workers see this comparison's _ROWS_VARIABLE. "local": even where
    # another Ray on the machine advertises itself.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for index in range(args.rounds):
            # Alternating order: on a shared machine, a load that changes over time falls on both sides.
            order = ("parquet", "memory") if index % 2 == 0 else ("memory", "parquet")
            rounds.append({side: measure(table if side == "parquet" else in_memory, args.steps, args.batch_size,
                                         directory / f"run-{side}-{index}", model,
                                         args.plan_ahead if side == "parquet" else None) for side in order})
    finally:
        ray.shutdown()
    ratios = [measured["parquet"]["step_seconds"] / measured["memory"]["step_seconds"] for measured in rounds]
    median_round = rounds[sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]]
    parquet, memory = median_round["parquet"], median_round["memory"]
    return {"rows": rows, "model": model, "layout": layout, "feature_bytes": rows * features * 4,
            "write_seconds": write_seconds, "parquet": parquet, "in_memory": memory,
            "in_memory_source": "mnist" if model == "gdp_cnn" else f"the first {memory_rows:,} synthetic rows",
            "step_time_ratio": parquet["step_seconds"] / memory["step_seconds"],
            "step_time_ratios_by_round": ratios}


def main(argv: list[str]) -> int:
    """Write each dataset, train on it and in memory, print (and with --json save) the comparisons."""
    parser = argparse.ArgumentParser(prog="python -m bench.out_of_core", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2_000_000],
                        help="training rows to write, one dataset per size (default 2,000,000)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--batch-size", type=int, default=250, help="expected batch size (default 250)")
    parser.add_argument("--dir", help="where to write the datasets (default: a temporary directory); kept after")
    parser.add_argument("--rounds", type=int, default=3,
                        help="Parquet/in-memory pairs, in alternating order; the median pair is reported (default 3)")
    parser.add_argument("--model", choices=tuple(MODELS), nargs="+", default=["gdp_cnn"],
                        help="gdp_cnn on 784 features (default) and/or mlp on 64")
    parser.add_argument("--layout", choices=LAYOUTS, nargs="+", default=["export"], help="the Parquet row groups")
    parser.add_argument("--memory-rows", type=int, default=MEMORY_ROWS,
                        help=f"the most rows the MLP's in-memory side holds (default {MEMORY_ROWS:,})")
    parser.add_argument("--plan-ahead", type=_plan_ahead, default=None,
                        help="train the Parquet side with plan_ahead_steps = this, a number, auto or off (default: "
                             "the key left out, which plans the batches as auto does)")
    parser.add_argument("--json", action="store_true", help="write bench/results/out_of_core-MODELS.json")
    parser.add_argument("--output", help="with --json, write this file instead (a sweep's layouts kept apart)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    comparisons = []
    for model in args.model:
        for layout in args.layout:
            for rows in args.rows:
                directory = Path(args.dir or tempfile.mkdtemp(prefix="dpfleet-out-of-core-")) / \
                    f"{model}-{layout}-{rows}"
                try:
                    comparison = compare(directory, rows, model, layout, args)
                finally:
                    if not args.dir:
                        shutil.rmtree(directory.parent, ignore_errors=True)
                comparisons.append(comparison)
                _print(comparison, args.plan_ahead)
                if args.json:
                    # After each comparison: a long sweep cut short keeps what it measured.
                    _save(argv, args, load_before, comparisons)
    return 0


def _save(argv: list[str], args, load_before: tuple, comparisons: list[dict]) -> None:
    results = {
        "command": "python -m bench.out_of_core " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                   f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "plan_ahead_steps": args.plan_ahead,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "workers": 2,
        "comparisons": comparisons,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    output = Path(args.output) if args.output else RESULTS_DIR / f"out_of_core-{'-'.join(args.model)}.json"
    output.write_text(json.dumps(results, indent=2) + "\n")


def _print(comparison: dict, plan_ahead) -> None:
    parquet, memory = comparison["parquet"], comparison["in_memory"]
    print(f"{comparison['model']}, layout {comparison['layout']}, {comparison['rows']:,} rows, "
          f"plan_ahead_steps {'left out' if plan_ahead is None else plan_ahead} (planned: "
          f"{parquet['planned_steps'] or 'no, rows one by one'}); in memory: {comparison['in_memory_source']}")
    print(f"  peak worker RSS (GB)  Parquet {parquet['worker_peak_rss_gb_max']:.3f}  "
          f"in memory {memory['worker_peak_rss_gb_max']:.3f}")
    print(f"  step (ms)             Parquet {1000 * parquet['step_seconds']:.1f}  "
          f"in memory {1000 * memory['step_seconds']:.1f}  ratio {comparison['step_time_ratio']:.2f} "
          f"(rounds {', '.join(f'{ratio:.2f}' for ratio in comparison['step_time_ratios_by_round'])}); "
          f"first step {1000 * parquet['first_step_seconds']:.0f} ms", flush=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
