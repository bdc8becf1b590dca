"""The attacker of docs/threat-model.md against real runs: nothing a run leaves behind recomputes its noise or samples.

Each run is recorded in the test's memory (`attacker.Truth`): every step's
unit noise vector and every sample, the driver's and each silo worker's.
`attacker.attack` then tries everything in every file the runs left (run
directories with their checkpoints, metrics, summary, config and plot, and
the runs' logs) as a key, a seed, a root entropy or a generator state, and
fails the test if any step's noise or sample comes out. The runs are not
seeded: a seed makes every key a public function of it, which is why a seeded
run says it is not for production use.

The runs add plain noise (secure_noise = false): its vectors derive from the
key exactly as secure noise's do (secure noise adds up four draws of the same
stream), and a plain vector's first values let the attacker check each of
its thousands of candidates in microseconds.
"""

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

import orchestrator.trainer as trainer_module
from attacker import Truth, attack, harvest, rows_found, version_one_poisson_sample
from orchestrator.checkpoint import save_checkpoint
from orchestrator.config import build_config
from orchestrator.noise import CHUNK_VALUES, GRADIENT_NOISE, GaussianNoise, fill_unit_normal
from orchestrator.sampling import poisson_sample, step_generator
from orchestrator.trainer import Trainer, resume_trainer
from workers.keys import SecretKey, process_key
from workers.sampling import local_poisson_sample, local_sampling_key
from workers.shard_worker import ShardWorker
from workers.sources import open_source

STEPS, CRASH_AT = 4, 2


class DriverCrash(Exception):
    pass


class RecordingTrainer(Trainer):
    """A trainer that records each step's sample and unit noise in `truth`, and dies after checkpoint `crash_at`."""

    truth: Truth
    crash_at: int | None = None

    def _draw_sample(self, step):
        indices, group_ids = super()._draw_sample(step)
        self.truth.add_sample("driver", step, indices, self.plan.dataset_size)
        return indices, group_ids

    def _apply_noise(self, partial_sums, unit_noise, noise_std):
        self.truth.noise[self.step] = torch.as_tensor(unit_noise).cpu().numpy().astype(np.float64)
        super()._apply_noise(partial_sums, unit_noise, noise_std)

    def _save_checkpoint(self):
        super()._save_checkpoint()
        if self.step == self.crash_at:
            raise DriverCrash


def recording_shard_worker(truth_dir: Path):
    """A ShardWorker actor class that writes each local sample it draws into `truth_dir` (the test's record)."""

    class RecordingShardWorker(ShardWorker):
        def _local_sample(self, step):
            indices = super()._local_sample(step)
            np.save(truth_dir / f"{self.shard_index}-{self.worker_index}-{step}.npy",
                    np.append(indices, self.train_size))
            return indices

    return ray.remote(RecordingShardWorker)


def attack_config(tmp_path, name, **overrides):
    values = dict(dataset="mnist", model="gdp_cnn", workers=1, steps=STEPS, batch_size=60, train_subset=600,
                  test_subset=200, noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.5, secure_noise=False,
                  checkpoint_every=2, run_dir=str(tmp_path / "runs" / name), max_physical_batch=64)
    values.update(overrides)
    return build_config({key: value for key, value in values.items() if value is not None})


def run_recorded(config, truth, log, crash_at=None):
    """Run `config` to its end, or to the checkpoint of step `crash_at` and then from it; return the trainers."""
    RecordingTrainer.truth, RecordingTrainer.crash_at = truth, crash_at
    with open(log, "w") as out:
        first = RecordingTrainer(config, show_progress=False, out=out)
        if crash_at is None:
            first.run()
            return first, None
        with pytest.raises(DriverCrash):
            first.run()
        RecordingTrainer.crash_at = None
        resumed = resume_trainer(config.run_dir, RecordingTrainer, show_progress=False, out=out)
        assert resumed.step == crash_at
        resumed.run()
        return first, resumed


def left_behind(tmp_path):
    """Every file the runs left: run directories (checkpoints, metrics, summary, config, plot) and logs."""
    return [tmp_path / "runs", tmp_path / "logs"]


def test_driver_sampling_finished_and_resumed_runs_leave_nothing_that_recomputes_noise_or_samples(
        local_ray, tmp_path):
    (tmp_path / "logs").mkdir()
    finished_truth, resumed_truth = Truth(0.1, secure=False), Truth(0.1, secure=False)
    run_recorded(attack_config(tmp_path, "finished"), finished_truth, tmp_path / "logs" / "finished.log")
    crashed, resumed = run_recorded(attack_config(tmp_path, "resumed"), resumed_truth,
                                    tmp_path / "logs" / "resumed.log", crash_at=CRASH_AT)
    for truth in (finished_truth, resumed_truth):
        assert sorted(truth.noise) == sorted(truth.samples["driver"]) == list(range(STEPS))
    # The resume drew a new key: the steps after the crash have fresh samples and noise.
    assert crashed.run_key.derive("x") != resumed.run_key.derive("x")
    for step in range(CRASH_AT, STEPS):
        assert not np.array_equal(poisson_sample(step_generator(crashed.run_key, step), 600, 0.1),
                                  resumed_truth.samples["driver"][step])
        assert not np.array_equal(GaussianNoise(crashed.run_key, secure=False).draw(8, 1.0, (GRADIENT_NOISE, step)),
                                  resumed_truth.noise[step][:8])
    found = harvest(left_behind(tmp_path))
    # The attacker did read the files: every checkpoint's tensors, and the integers of the logs, metrics and summary.
    assert {Path(where.split("[")[0]).name for _, where in found.float_arrays} >= {
        f"checkpoint-{crashed.record.run_id}-{step:09d}.pt" for step in (CRASH_AT, STEPS)}
    assert len(found.integers) > 20
    assert attack(found, finished_truth) == [] and attack(found, resumed_truth) == []
    # Nor does any file hold a training example, as the workers read it.
    training_rows, _ = open_source("mnist", "train").read(np.arange(600))
    assert rows_found(left_behind(tmp_path), training_rows) == []


def test_local_sampling_in_silos_leaves_nothing_that_recomputes_a_workers_samples(
        local_ray, tmp_path, monkeypatch):
    truth_dir = tmp_path / "truth"
    truth_dir.mkdir()
    (tmp_path / "logs").mkdir()
    monkeypatch.setattr(trainer_module, "ShardWorkerActor", recording_shard_worker(truth_dir))
    config = attack_config(tmp_path, "silos", train_subset=None, workers=None, batch_size=30,
                           shards=[{"part": 0, "parts": 100}, {"part": 1, "parts": 100}])
    truth = Truth(30 / 1200, secure=False)
    run_recorded(config, truth, tmp_path / "logs" / "silos.log", crash_at=CRASH_AT)
    for record in truth_dir.glob("*.npy"):
        shard, worker, step = (int(part) for part in record.stem.split("-"))
        drawn = np.load(record)
        truth.add_sample((shard, worker), step, drawn[:-1], int(drawn[-1]))
    assert sorted(truth.samples) == [(0, 0), (1, 0)] and sorted(truth.noise) == list(range(STEPS))
    assert all(sorted(steps) == list(range(STEPS)) for steps in truth.samples.values())
    found = harvest(left_behind(tmp_path))
    assert attack(found, truth) == []


# --- the attacker itself: it finds each secret the checkpoints once held ---------------------------------------


def old_run(steps=4, dataset_size=600, rate=0.1, size=1000):
    """A run as the first checkpoint format saw it: one sampler generator, and noise from a SeedSequence's entropy."""
    truth = Truth(rate, secure=True)
    sampler = np.random.default_rng()
    entropy = np.random.SeedSequence().entropy
    for step in range(steps):
        truth.add_sample("driver", step, version_one_poisson_sample(sampler, dataset_size, rate), dataset_size)
        values = np.empty(min(size, CHUNK_VALUES))
        generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy,
                                                                              spawn_key=(GRADIENT_NOISE, step, 0))))
        fill_unit_normal(generator, values, 4)
        truth.noise[step] = values
    drawn_ahead = version_one_poisson_sample(sampler, dataset_size, rate)
    truth.add_sample("driver", steps, drawn_ahead, dataset_size)
    return truth, sampler.bit_generator.state, entropy, drawn_ahead


@pytest.mark.parametrize("field", ["sampler", "noise", "drawn_sample"])
def test_the_attacker_recovers_each_secret_of_a_version_1_checkpoint(tmp_path, field):
    truth, sampler_state, entropy, drawn_ahead = old_run()
    held = {"sampler": sampler_state, "noise": {"entropy": entropy, "secure": True},
            "drawn_sample": (drawn_ahead, None)}[field]
    save_checkpoint(tmp_path, "0123456789abcdef", 4, {"version": 1, "step": 4, field: held})
    findings = attack(harvest([tmp_path]), truth)
    reproduced = {"sampler": [f"sample of driver at step {step}" for step in range(4)],
                  "noise": [f"noise of step {step}" for step in range(4)],
                  "drawn_sample": ["sample of driver at step 4"]}[field]
    for finding in reproduced:
        assert any(finding in line for line in findings), (finding, findings)


def test_the_attacker_finds_a_seed_and_a_key_through_the_projects_own_derivation(tmp_path):
    seeded = Truth(0.1, secure=True)
    noise = GaussianNoise(process_key(5))
    seeded.noise[0] = noise.draw(1000, 1.0, (GRADIENT_NOISE, 0))
    seeded.add_sample("driver", 0, poisson_sample(step_generator(process_key(5), 0), 600, 0.1), 600)
    (tmp_path / "config.json").write_text('{"seed": 5}')
    findings = attack(harvest([tmp_path]), seeded)
    assert any("as the driver's seed reproduces the noise of step 0" in line for line in findings)
    assert any("as the driver's seed reproduces the sample of driver at step 0" in line for line in findings)
    # A silo worker's key, had it been logged, gives that worker's samples.
    local = Truth(0.1, secure=True)
    key = local_sampling_key(None, 0, 0)
    local.noise[0] = GaussianNoise().draw(8, 1.0, (GRADIENT_NOISE, 0))
    local.add_sample((0, 0), 3, local_poisson_sample(key, 3, 600, 0.1), 600)
    (tmp_path / "config.json").unlink()
    (tmp_path / "worker.log").write_text(f"worker key {key._material.hex()}\n")
    findings = attack(harvest([tmp_path]), local)
    assert any("reproduces the sample of (0, 0) at step 3" in line for line in findings), findings


def test_a_keys_derivations_are_separate_by_purpose_and_numbers_and_a_seeds_key_is_not_anothers_output():
    key = SecretKey.fresh()
    outputs = {key.derive("noise", 0, 1), key.derive("noise", 1, 0), key.derive("noise", 0, 1, 0),
               key.derive("sample", 0, 1), key.derive("sample", 1), SecretKey.fresh().derive("noise", 0, 1)}
    assert len(outputs) == 6 and all(len(output) == 32 for output in outputs)
    assert key.derive("noise", 0, 1) == key.derive("noise", 0, 1)
    assert SecretKey.from_seed(5).seeded and not key.seeded
    assert SecretKey.from_seed(5).derive("noise") == process_key(5).derive("noise") != process_key(6).derive("noise")
    with pytest.raises(ValueError, match="0..2\\*\\*64 - 1"):
        key.derive("noise", -1)
    with pytest.raises(ValueError, match="a key is 32 bytes"):
        SecretKey(b"short")


def test_the_attacker_finds_a_training_row_written_anywhere(tmp_path):
    rows, _ = open_source("mnist", "train").read(np.arange(3))
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "cache.bin").write_bytes(b"header" + rows[2].to(torch.float32).numpy().tobytes() + b"tail")
    assert rows_found([tmp_path], rows) == [f"{tmp_path / 'cache.bin'}: row 2"]



def test_batches_planned_ahead_leave_no_membership_and_a_resumed_run_plans_afresh(
        local_ray, tmp_path, monkeypatch):
    """A planned run from pyarrow-default Parquet, crashed and resumed: its windows' folders (which say who is in
    which step) are gone each time the run stops, and nothing it left recomputes a sample or holds a row."""
    images, labels = open_source("mnist", "train").read(np.arange(600))
    data = tmp_path / "parquet"
    data.mkdir()
    element = pa.field("element", pa.float32(), nullable=False)
    pq.write_table(pa.table({"features": pa.FixedSizeListArray.from_arrays(
        pa.array(images.reshape(600, -1).numpy().ravel()), type=pa.list_(element, 784)), "label": labels.numpy()}),
        data / "part-0.parquet")
    spec = {"format": "parquet", "train": str(data), "test": str(data), "features": "features", "shape": [1, 28, 28]}
    windows = tmp_path / "windows"
    windows.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(windows))
    (tmp_path / "logs").mkdir()
    truth = Truth(0.1, secure=False)
    crashed, resumed = run_recorded(attack_config(tmp_path, "planned", dataset=spec, train_subset=None,
                                                  plan_ahead_steps=3), truth, tmp_path / "logs" / "planned.log",
                                    crash_at=CRASH_AT)
    assert list(windows.iterdir()) == []
    assert sorted(truth.samples["driver"]) == list(range(STEPS))
    # The resumed run planned its steps with a new key, not the crashed run's window.
    for step in range(CRASH_AT, STEPS):
        assert not np.array_equal(poisson_sample(step_generator(crashed.run_key, step), 600, 0.1),
                                  truth.samples["driver"][step])
    assert attack(harvest(left_behind(tmp_path)), truth) == []
    assert rows_found(left_behind(tmp_path), images) == []
