"""Faults: torn checkpoints, resumed runs and killed workers change nothing that was computed; a resume is refused
unless it continues the same run, on the same data, under the same reservation."""

import json
import os
import signal
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch

from orchestrator.checkpoint import checkpoint_files, latest_checkpoint, read_checkpoint, save_checkpoint
from orchestrator.cli.train import job_ledger
from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator import trainer as trainer_module
from orchestrator.trainer import LOCAL_RAY_START_ATTEMPTS, Trainer, resume_trainer, start_ray
from workers.data import load_split
from workers.models import flat_parameters
from workers.sources import write_parquet_shards


RUN, OTHER_RUN = "0123456789abcdef", "fedcba9876543210"


def test_checkpoints_round_trip_and_keep_the_newest_two(tmp_path):
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, RUN, step, {"step": step, "weights": torch.arange(3.0) * step})
    assert [path.name for path in checkpoint_files(tmp_path)] == [f"checkpoint-{RUN}-000000010.pt",
                                                                  f"checkpoint-{RUN}-000000015.pt"]
    path, state = latest_checkpoint(tmp_path)
    assert state["step"] == 15 and torch.equal(state["weights"], torch.arange(3.0) * 15)
    assert not list(tmp_path.glob("*.tmp"))


def test_runs_sharing_a_folder_prune_only_their_own_checkpoints_and_the_last_written_is_resumed(tmp_path):
    for step in (20, 30, 40):
        save_checkpoint(tmp_path, RUN, step, {"step": step})
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, OTHER_RUN, step, {"step": step})
    assert [path.name for path in checkpoint_files(tmp_path, RUN)] == [f"checkpoint-{RUN}-000000030.pt",
                                                                       f"checkpoint-{RUN}-000000040.pt"]
    assert len(checkpoint_files(tmp_path, OTHER_RUN)) == 2
    # Steps of two runs do not compare: the checkpoint written last is the newest, whatever its step.
    assert latest_checkpoint(tmp_path)[1]["step"] == 3


def test_a_torn_checkpoint_is_never_loaded_and_the_previous_one_is_used(tmp_path):
    save_checkpoint(tmp_path, RUN, 5, {"step": 5})
    newest = save_checkpoint(tmp_path, RUN, 10, {"step": 10, "blob": torch.zeros(1000)})
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    assert read_checkpoint(newest) is None
    assert latest_checkpoint(tmp_path)[1]["step"] == 5


def test_a_checkpoint_with_flipped_bytes_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, RUN, 1, {"step": 1, "blob": torch.ones(100)})
    data = bytearray(path.read_bytes())
    data[-50] ^= 0xFF
    path.write_bytes(bytes(data))
    assert read_checkpoint(path) is None and latest_checkpoint(tmp_path) is None


def test_resume_without_a_checkpoint_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no config.json"):
        resume_trainer(str(tmp_path))


def fault_config(tmp_path, name, **overrides):
    values = dict(
        dataset="mnist", model="gdp_cnn", workers=2, steps=12, batch_size=60, train_subset=600,
        test_subset=200, noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.5, seed=8,
        run_dir=str(tmp_path / name), max_physical_batch=32, optimizer={"name": "momentum"},
    )
    values.update(overrides)
    return build_config(values)


class KillFirstWorkerDuring(Trainer):
    """A trainer that kills one worker process with SIGKILL while step `at_step` is in flight."""

    at_step = 4

    def _partial_sums(self, workers, weights, shards, group_shards, next_shards):
        if self.step == self.at_step and not getattr(self, "killed", False):
            self.killed = True
            pid = int(ray.get(workers[0].ping.remote()).rsplit(":", 1)[1])
            # Let the call start, then kill the process in the middle of it.
            threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
        return super()._partial_sums(workers, weights, shards, group_shards, next_shards)


def test_a_killed_worker_changes_neither_weights_nor_epsilon(local_ray, worker_pool, tmp_path):
    calm = Trainer(fault_config(tmp_path, "calm"), show_progress=False)
    calm_summary = calm.run()
    disturbed = KillFirstWorkerDuring(fault_config(tmp_path, "disturbed"), show_progress=False)
    disturbed_summary = disturbed.run()
    assert disturbed.killed
    np.testing.assert_allclose(flat_parameters(disturbed.model), flat_parameters(calm.model), atol=1e-6, rtol=0)
    assert disturbed_summary["epsilon"] == calm_summary["epsilon"]
    assert disturbed_summary["steps"] == calm_summary["steps"] == 12


class DriverCrash(Exception):
    pass


class CrashAfterCheckpoint(Trainer):
    """A driver that dies right after writing the checkpoint of step `crash_at`."""

    crash_at = 5

    def _save_checkpoint(self):
        super()._save_checkpoint()
        if self.step == self.crash_at:
            raise DriverCrash


def test_resuming_from_a_checkpoint_reproduces_the_uninterrupted_run(local_ray, worker_pool, tmp_path):
    whole = Trainer(fault_config(tmp_path, "whole", checkpoint_every=5), show_progress=False)
    whole_summary = whole.run()
    with pytest.raises(DriverCrash):
        CrashAfterCheckpoint(fault_config(tmp_path, "split", checkpoint_every=5), show_progress=False).run()
    resumed = resume_trainer(str(tmp_path / "split"), show_progress=False)
    assert resumed.step == 5
    summary = resumed.run()
    assert summary["steps"] == 12 and summary["epsilon"] == whole_summary["epsilon"]
    np.testing.assert_allclose(flat_parameters(resumed.model), flat_parameters(whole.model), atol=1e-6, rtol=0)


def fake_ray_init(monkeypatch, failures, message="The current node timed out during startup."):
    """Make ray.init fail `failures` times with `message`, then succeed; return the list of its calls."""
    calls = []

    def init(**options):
        calls.append(options)
        if len(calls) <= failures:
            raise Exception(message)  # what Ray raises when its local node does not come up

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(trainer_module.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(trainer_module.ray, "init", init)
    monkeypatch.setattr(trainer_module.ray, "shutdown", lambda: None)
    monkeypatch.setattr(trainer_module.time, "sleep", lambda seconds: None)
    return calls


@pytest.mark.parametrize("message", [
    "The current node timed out during startup.",
    "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_0123",
])
def test_a_local_ray_start_that_times_out_is_retried_and_said(monkeypatch, message):
    calls = fake_ray_init(monkeypatch, failures=LOCAL_RAY_START_ATTEMPTS - 1, message=message)
    said = []
    assert start_ray(build_config(dict(steps=1, noise_multiplier=1.0)), said.append) is True
    assert len(calls) == LOCAL_RAY_START_ATTEMPTS
    assert said == [f"local Ray did not start in time (try {n} of {LOCAL_RAY_START_ATTEMPTS}); trying again"
                    for n in range(1, LOCAL_RAY_START_ATTEMPTS)]


def test_a_local_ray_start_gives_up_after_its_attempts_and_other_errors_are_not_retried(monkeypatch):
    calls = fake_ray_init(monkeypatch, failures=LOCAL_RAY_START_ATTEMPTS)
    with pytest.raises(Exception, match="timed out during startup"):
        start_ray(build_config(dict(steps=1, noise_multiplier=1.0)), lambda line: None)
    assert len(calls) == LOCAL_RAY_START_ATTEMPTS
    calls = fake_ray_init(monkeypatch, failures=1, message="bad argument")
    with pytest.raises(Exception, match="bad argument"):
        start_ray(build_config(dict(steps=1, noise_multiplier=1.0)), lambda line: None)
    assert len(calls) == 1



def write_run(run_dir, config, trainer):
    """A run directory as a run leaves it: config.json and a checkpoint of `trainer` after 0 steps."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    save_checkpoint(run_dir, trainer.record.run_id, 0, trainer.state())


def test_a_resume_with_another_config_is_refused_naming_what_differs(tmp_path):
    config = fault_config(tmp_path, "run", seed=None)
    write_run(tmp_path / "run", config, Trainer(config, show_progress=False))
    # Another run reused the folder and wrote its config.json before it had a checkpoint of its own.
    other = fault_config(tmp_path, "run", seed=None, train_subset=300, learning_rate=0.1, workers=1)
    (tmp_path / "run" / "config.json").write_text(json.dumps(other.to_dict()))
    with pytest.raises(UsageError) as refused:
        resume_trainer(str(tmp_path / "run"), show_progress=False)
    message = str(refused.value)
    assert "config key train_subset: 600 in the checkpoint, 300 now" in message
    assert "config key learning_rate: 0.5 in the checkpoint, 0.1 now" in message
    assert "dataset units: 600 in the checkpoint, 300 now" in message
    assert "workers" not in message  # where the work runs may change between a run and its resume
    assert "start a new run: dpfleet train --config FILE --run-dir NEW_DIR" in message
    # The same config (on more workers) resumes, as the run it is, under its own id.
    (tmp_path / "run" / "config.json").write_text(json.dumps({**config.to_dict(), "workers": 1}))
    resumed = resume_trainer(str(tmp_path / "run"), show_progress=False)
    assert resumed.record.run_id == latest_checkpoint(tmp_path / "run")[1]["run_id"]


def test_a_resume_on_changed_data_is_refused(tmp_path):
    images, labels = load_split("mnist", "train")
    data = tmp_path / "data"
    for split in ("train", "test"):
        write_parquet_shards(str(data / split), [(images[:200].numpy(), labels[:200].numpy())], 200, 2)
    table = {"format": "parquet", "train": str(data / "train"), "test": str(data / "test"), "shape": [1, 28, 28],
             "features": "features"}
    config = fault_config(tmp_path, "run", dataset=table, train_subset=None, test_subset=None, batch_size=20)
    write_run(tmp_path / "run", config, Trainer(config, show_progress=False))
    assert resume_trainer(str(tmp_path / "run"), show_progress=False).step == 0  # the same files: the same run
    # The same rows and schema, one label changed, written again in place.
    changed = labels[:200].numpy().copy()
    changed[150] = (changed[150] + 1) % 10
    write_parquet_shards(str(data / "train"), [(images[:200].numpy(), changed)], 200, 2)
    with pytest.raises(UsageError, match=r"dataset content: \"[0-9a-f]{64}\" in the checkpoint, \"[0-9a-f]{64}\" now"):
        resume_trainer(str(tmp_path / "run"), show_progress=False)


def test_a_checkpoint_of_the_first_format_is_refused_because_it_holds_secrets(tmp_path):
    config = fault_config(tmp_path, "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(config.to_dict()))
    save_checkpoint(tmp_path / "run", RUN, 5, {"version": 1, "step": 5, "sampler": {}, "noise": {"entropy": 1}})
    (tmp_path / "run" / f"checkpoint-{RUN}-000000005.pt").rename(tmp_path / "run" / "checkpoint-000000005.pt")
    with pytest.raises(UsageError, match="version 1, which holds the run's noise and sampling secrets.*delete it"):
        resume_trainer(str(tmp_path / "run"), show_progress=False)


def test_a_checkpoint_holds_no_key_generator_state_or_drawn_sample(tmp_path):
    trainer = Trainer(fault_config(tmp_path, "run", seed=None), show_progress=False)
    trainer.drawn_sample = trainer._draw_sample(0)
    state = trainer.state()
    assert not {"sampler", "drawn_sample", "noise", "entropy"} & set(state)
    # A key cannot be written even by mistake: it refuses to be pickled.
    with pytest.raises(TypeError, match="memory only"):
        save_checkpoint(tmp_path, RUN, 1, {**state, "key": trainer.run_key})


def test_a_resume_charged_to_another_ledger_dataset_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("DPFLEET_LEDGER", raising=False)
    config = fault_config(tmp_path, "run")
    resumed = SimpleNamespace(config=config, say=print, resumed_reservation_id="r-7",
                              resumed_reservation={"id": "r-7", "dataset": "digits"})
    args = SimpleNamespace(ledger=None, token=None, dataset_name="letters", wait_for_budget=False)
    with pytest.raises(UsageError, match="charged to the ledger's dataset 'digits'.*--dataset-name digits"):
        job_ledger(args, resumed)
