"""Silo mode from Parquet: each silo's workers plan their own samples and gather them with Ray Data on their node.

A real loopback cluster of a head with no CPUs and two 1-CPU silo nodes (never a mocked Ray).
"""

import io
import os
import shutil
import tempfile

import pytest
from servers import start_loopback_cluster, stop_loopback_cluster
from test_planned_batches import write_default_parquet

from orchestrator.config import build_config, planned_batch_steps
from orchestrator.errors import UsageError
from orchestrator.trainer import Trainer
from workers.data import load_split
from workers.models import flat_parameters

SILOS = ("silo-a", "silo-b")


def silo_config(tmp_path, name, dataset, **overrides):
    values = dict(
        model="gdp_cnn", steps=3, batch_size=40, test_subset=100, noise_multiplier=1.0, clip_norm=1.0,
        learning_rate=0.5, seed=7, run_dir=str(tmp_path / name), max_physical_batch=32,
        shards=[{"dataset": dataset, "part": part, "parts": 2, "resources": {silo: 1}}
                for part, silo in enumerate(SILOS)],
    )
    values.update(overrides)
    return build_config(values)


def test_silos_train_from_pyarrow_default_parquet_on_their_own_nodes_as_from_memory(tmp_path, monkeypatch):
    images, labels = load_split("mnist", "train")
    # MNIST's whole training split in pyarrow's default row groups: the same N, so each silo samples as in memory.
    spec = write_default_parquet(tmp_path / "mnist", images.numpy(), labels.numpy(), files=3)
    # The silos' workers inherit it from the nodes: their windows' folders go here (and Ray's, whose socket
    # paths must stay short).
    windows = tempfile.mkdtemp(prefix="dpw-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", windows)
    cluster, _ = start_loopback_cluster([dict(num_cpus=1, resources={silo: 1}) for silo in SILOS])
    try:
        # Two steps a window over three steps: each silo gathers its second window while its first trains.
        planned = Trainer(silo_config(tmp_path, "planned", spec, plan_ahead_steps=2), show_progress=False,
                          out=io.StringIO())
        planned.run()
        in_memory = Trainer(silo_config(tmp_path, "memory", "mnist"), show_progress=False, out=io.StringIO())
        in_memory.run()
        left = [name for name in os.listdir(windows) if name.startswith("dpfleet-window-")]
    finally:
        stop_loopback_cluster(cluster)
        shutil.rmtree(windows, ignore_errors=True)
    # The same seeded silo keys, rows and noise: the same samples, sums and steps.
    assert planned.step == 3
    assert_close = pytest.importorskip("torch").testing.assert_close
    assert_close(flat_parameters(planned.model), flat_parameters(in_memory.model))
    # Every window's folder was deleted by its silo's worker.
    assert left == []


@pytest.mark.parametrize("overrides, message", [
    (dict(plan_ahead_steps="off"), "reads its files only through batches planned ahead"),
    (dict(mixed=True), "give every shard a parquet dataset"),
    (dict(plan_ahead_steps=2, mixed=True), "give every shard a parquet dataset"),
])
def test_parquet_silos_are_read_only_through_planned_batches(tmp_path, overrides, message):
    spec = write_default_parquet(tmp_path / "data", load_split("mnist", "train")[0][:50].numpy(),
                                 load_split("mnist", "train")[1][:50].numpy(), files=1)
    # Left out, the key plans each silo's batches.
    assert planned_batch_steps(silo_config(tmp_path, "default", spec)) == "auto"
    mixed = overrides.pop("mixed", False)
    shards = [{"dataset": spec, "part": 0, "parts": 2, "resources": {"silo-a": 1}},
              {"dataset": "mnist" if mixed else spec, "part": 1, "parts": 2, "resources": {"silo-b": 1}}]
    with pytest.raises(UsageError, match=message):
        silo_config(tmp_path, "refused", spec, **overrides, shards=shards)
