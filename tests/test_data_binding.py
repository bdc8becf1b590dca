"""A run is bound to every byte of its data: a resume on data changed in any way is refused, in every mode.

The attacks: rewrite most of a CSV outside the byte ranges a sampling
fingerprint would read and set its modification time back (``os.utime``);
replace a silo's Parquet rows with random rows of the same count. Each
resume must be refused, naming what differs.
"""

import hashlib
import io
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from servers import start_loopback_cluster, stop_loopback_cluster
from test_planned_batches import write_default_parquet

from orchestrator.checkpoint import save_checkpoint
from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.trainer import Trainer, resume_trainer
from workers.data import load_split
from workers.fingerprints import dataset_identity

FEATURES, CLASSES, ROWS = 8, 3, 4000
MODEL = """
from torch import nn


def build():
    return nn.Linear(8, 3)
"""
# What a sampling fingerprint reads: this many evenly spaced ranges of this many bytes, with size and mtime.
SAMPLED_RANGES, SAMPLED_BYTES = 16, 4096


def write_csv(path):
    """ROWS rows of FEATURES six-decimal features and an integer label: about 260 KB."""
    generator = np.random.default_rng(5)
    features = generator.random((ROWS, FEATURES))
    lines = [",".join([*(f"x{column}" for column in range(FEATURES)), "label"])]
    lines += [",".join([*(f"{value:.6f}" for value in row), str(row_index % CLASSES)])
              for row_index, row in enumerate(features)]
    path.write_text("\n".join(lines) + "\n")


def sampled_starts(size):
    """Where the sampling fingerprint's ranges start in a file of `size` bytes."""
    return [round(index * (size - SAMPLED_BYTES) / (SAMPLED_RANGES - 1)) for index in range(SAMPLED_RANGES)]


def sampling_fingerprint(path):
    """The forgeable identity: size, modification time and sampled byte ranges."""
    data, info = path.read_bytes(), os.stat(path)
    sampled = b"".join(data[start:start + SAMPLED_BYTES] for start in sampled_starts(len(data)))
    return hashlib.blake2b(len(data).to_bytes(8, "big") + info.st_mtime_ns.to_bytes(8, "big") + sampled).hexdigest()


def forge_outside_the_samples(path):
    """Change every feature digit outside the sampled ranges (the labels stay valid), keep the size and set the
    modification time back; return the share of the file's bytes outside the ranges."""
    before = os.stat(path)
    data = bytearray(path.read_bytes())
    sampled = np.zeros(len(data), dtype=bool)
    for start in sampled_starts(len(data)):
        sampled[start:start + SAMPLED_BYTES] = True
    in_label = np.zeros(len(data), dtype=bool)
    line_start = 0
    for position, byte in enumerate(data):
        if byte == ord("\n"):
            in_label[data.rindex(b",", line_start, position):position] = True
            line_start = position + 1
    changed = 0
    for position in np.flatnonzero(~sampled & ~in_label):
        if chr(data[position]).isdigit() and data[position - 1] != ord(","):  # a digit after "0."
            data[position] = ord("0") + (data[position] - ord("0") + 1) % 10
            changed += 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert changed > 0.4 * len(data)
    return 1 - sampled.mean()


def test_a_csv_rewritten_outside_the_sampled_ranges_with_its_mtime_set_back_is_refused(tmp_path, monkeypatch):
    train, test = tmp_path / "train.csv", tmp_path / "test.csv"
    write_csv(train)
    write_csv(test)
    (tmp_path / "linear_model.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = build_config(dict(
        dataset={"format": "csv", "train": str(train), "test": str(test)}, model="linear_model:build", workers=1,
        steps=2, batch_size=40, noise_multiplier=1.0, learning_rate=0.1, run_dir=str(tmp_path / "run")))
    trainer = Trainer(config, show_progress=False, out=io.StringIO())
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(config.to_dict()))
    save_checkpoint(tmp_path / "run", trainer.record.run_id, 0, trainer.state())
    identity, sampled = dataset_identity(config.dataset), sampling_fingerprint(train)
    size, mtime = os.stat(train).st_size, os.stat(train).st_mtime_ns

    outside = forge_outside_the_samples(train)
    # The forgery: 60% of the file rewritten, the same size and modification time, and every sampled byte the
    # same, so that a fingerprint of sizes, times and sampled ranges stays what it was.
    assert outside > 0.6 and (os.stat(train).st_size, os.stat(train).st_mtime_ns) == (size, mtime)
    assert sampling_fingerprint(train) == sampled
    assert dataset_identity(config.dataset)["content"] != identity["content"]
    with pytest.raises(UsageError, match=r"dataset content: \"[0-9a-f]{64}\" in the checkpoint, \"[0-9a-f]{64}\" now"):
        resume_trainer(str(tmp_path / "run"), show_progress=False, out=io.StringIO())


SILOS = ("silo-a", "silo-b")
SILO_ROWS = 60


def test_a_resume_on_a_silos_rows_replaced_by_random_rows_of_the_same_count_is_refused(tmp_path, monkeypatch):
    images, labels = load_split("mnist", "train")
    specs = [write_default_parquet(tmp_path / silo, images[index * SILO_ROWS:(index + 1) * SILO_ROWS].numpy(),
                                   labels[index * SILO_ROWS:(index + 1) * SILO_ROWS].numpy(), files=1)
             for index, silo in enumerate(SILOS)]
    config = build_config(dict(
        model="gdp_cnn", steps=2, batch_size=20, test_subset=20, noise_multiplier=1.0, learning_rate=0.5,
        run_dir=str(tmp_path / "run"), max_physical_batch=32, plan_ahead_steps=2,
        shards=[{"dataset": spec, "part": 0, "parts": 1, "resources": {silo: 1}}
                for spec, silo in zip(specs, SILOS, strict=True)]))
    windows = tempfile.mkdtemp(prefix="dpw-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", windows)
    cluster, _ = start_loopback_cluster([dict(num_cpus=1, resources={silo: 1}) for silo in SILOS])
    try:
        trainer = Trainer(config, show_progress=False, out=io.StringIO())
        # Each silo's identity was taken by its own worker, on its node, from its own files.
        assert trainer.dataset_identity["shard 1"] == dataset_identity(specs[1])
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / "config.json").write_text(json.dumps(config.to_dict()))
        save_checkpoint(tmp_path / "run", trainer.record.run_id, 0, trainer.state())
        trainer.shards.close()
        # Silo b's file rewritten with random rows of the same count and schema: N, the specs and the footer's
        # row counts are what they were.
        generator = np.random.default_rng(9)
        shutil.rmtree(tmp_path / SILOS[1])
        write_default_parquet(tmp_path / SILOS[1], generator.random((SILO_ROWS, 1, 28, 28), dtype=np.float32),
                              generator.integers(0, 10, SILO_ROWS), files=1)
        with pytest.raises(UsageError) as refused:
            resume_trainer(str(tmp_path / "run"), show_progress=False, out=io.StringIO())
    finally:
        stop_loopback_cluster(cluster)
        shutil.rmtree(windows, ignore_errors=True)
    message = str(refused.value)
    assert "dataset shard 1 content:" in message and "shard 0" not in message and "units" not in message
