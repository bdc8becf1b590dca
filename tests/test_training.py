"""DP-SGD end to end on a real local Ray with 2 workers, on small MNIST subsets."""

import io
import json

import numpy as np
import pytest
import ray
import torch
import torch.nn.functional as F
from torch import nn

import orchestrator.sampling as sampling_module
from accounting.accountants import get_accountant
from accounting.events import SampledGaussian
from orchestrator.adaptive_clipping import effective_noise_multiplier
from orchestrator.cli import main
from orchestrator.config import build_config
from orchestrator.noise import GRADIENT_NOISE, GaussianNoise
from orchestrator.checkpoint import latest_checkpoint
from orchestrator.sampling import assign_microbatches, poisson_sample, step_generator, worker_shares
from orchestrator.run_record import BREAKDOWN
from orchestrator.trainer import Trainer, resume_trainer
from accounting.ledger.store import open_embedded_ledger
from servers import TINY_JOB
from reference import clipped_sum_by_loop, per_example_gradients_by_loop, relative_error
from workers.actor import GradientWorkerActor
from workers.data import load_split
from workers.keys import SecretKey, process_key
from workers.models import MODEL_NAMES, build_model, flat_parameters, load_flat_parameters


class RecordingNoise(GaussianNoise):
    """The driver's noise source, keeping the key, size and std of every vector it draws."""

    def __init__(self, seed):
        super().__init__(SecretKey.from_seed(seed))
        self.draws = []

    def draw(self, size, std, key, out=None):
        self.draws.append((tuple(key), size, std))
        return super().draw(size, std, key, out)


class NoiseRecordingTrainer(Trainer):
    """A trainer that keeps the noise it adds at each step: sigma C times the step's unit vector."""

    def _apply_noise(self, partial_sums, unit_noise, noise_std):
        self.added = getattr(self, "added", []) + [noise_std * np.array(unit_noise)]
        super()._apply_noise(partial_sums, unit_noise, noise_std)


def batchnorm_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 26 * 26, 16), nn.BatchNorm1d(16), nn.Linear(16, 10),
    )


# The ScatterNets' workers train their heads on cached features: tests/test_accuracy_features.py checks those sums.
@pytest.mark.parametrize("model_name", [name for name in MODEL_NAMES if not name.startswith("scatternet")])
def test_distributed_clipped_sum_equals_a_plain_loop(local_ray, model_name):
    torch.manual_seed(5)
    model = build_model(model_name)
    weights = flat_parameters(model).numpy()
    workers = [GradientWorkerActor.options(num_cpus=1).remote(model_name, "mnist", 300, 16) for _ in range(2)]
    indices = np.random.default_rng(4).choice(300, size=24, replace=False)
    images, labels = load_split("mnist", "train")
    gradients = per_example_gradients_by_loop(model, torch.from_numpy(weights), images[indices], labels[indices])
    clip_norm = gradients.norm(dim=1).median().item()
    shards = np.array_split(indices, 2)
    partial = ray.get([w.clipped_grad_sum.remote(weights, s, clip_norm) for w, s in zip(workers, shards)])
    assert relative_error(torch.from_numpy(partial[0] + partial[1]), clipped_sum_by_loop(gradients, clip_norm)) < 1e-5
    for worker in workers:
        ray.kill(worker)


def small_config(tmp_path, **overrides):
    values = dict(
        dataset="mnist", model="gdp_cnn", workers=2, steps=5, batch_size=60, train_subset=600,
        test_subset=500, noise_multiplier=1.1, clip_norm=1.0, learning_rate=0.5, seed=13,
        run_dir=str(tmp_path / "run"), max_physical_batch=32,
    )
    values.update(overrides)
    return build_config(values)


def test_noise_is_drawn_once_per_step_not_per_worker(local_ray, worker_pool, tmp_path):
    config = small_config(tmp_path, steps=5)
    noise = RecordingNoise(seed=1)
    trainer = NoiseRecordingTrainer(config, noise=noise, show_progress=False)
    trainer.run()
    parameter_count = flat_parameters(trainer.model).numel()
    # One unit vector per step, keyed by the step, whatever the number of workers; sigma C is applied when added.
    assert noise.draws == [((GRADIENT_NOISE, step), parameter_count, 1.0) for step in range(5)]
    coordinates = np.concatenate(trainer.added)
    assert coordinates.size >= 100_000
    assert coordinates.std() == pytest.approx(config.noise_multiplier * config.clip_norm, rel=0.03)


def test_an_empty_batch_still_adds_noise_and_steps(local_ray, worker_pool, tmp_path, monkeypatch):
    monkeypatch.setattr(sampling_module, "poisson_sample", lambda *args: np.array([], dtype=np.int64))
    config = small_config(tmp_path, steps=1, optimizer="sgd")
    log = io.StringIO()
    trainer = NoiseRecordingTrainer(config, show_progress=False, out=log)
    before = flat_parameters(trainer.model).double()
    summary = trainer.run()
    after = flat_parameters(trainer.model).double()
    expected_step = config.learning_rate * torch.from_numpy(trainer.added[0]) / config.batch_size
    torch.testing.assert_close(before - after, expected_step.to(torch.float32).double(), rtol=1e-4, atol=1e-7)
    assert summary["steps"] == 1
    # The engine is settled on synthetic examples as the workers start, so the start says it with no example seen.
    assert "clipping engine, per layer: 0 (Conv2d): fast (per-example)" in log.getvalue()


class WeightRecordingTrainer(Trainer):
    """A trainer that keeps the training weights after each step."""

    def _apply_noise(self, partial_sums, unit_noise, noise_std):
        super()._apply_noise(partial_sums, unit_noise, noise_std)
        self.trained = getattr(self, "trained", []) + [self.flat_weights.clone()]


def test_parameter_averaging_is_what_is_evaluated_and_saved_while_training_steps_the_weights(local_ray, worker_pool,
                                                                                             tmp_path):
    config = small_config(tmp_path, steps=4, ema_decay=0.2, test_subset=300, workers=1)
    trainer = WeightRecordingTrainer(config, show_progress=False)
    average = trainer.flat_weights.clone()
    summary = trainer.run()
    # decay min(0.2, (1 + t) / (10 + t)) at step t: 0.1, 2/11, then 0.2.
    for decay, weights in zip([0.1, 2 / 11, 0.2, 0.2], trainer.trained, strict=True):
        average = decay * average + (1 - decay) * weights
    torch.testing.assert_close(trainer.ema_weights, average)
    # Training went on from the weights themselves: each step starts where the last one left them.
    assert torch.equal(trainer.flat_weights, trainer.trained[-1])
    assert (trainer.flat_weights - average).norm() > 1e-3 * average.norm()
    images, labels = load_split("mnist", "test")

    def test_loss(weights):
        model = build_model("gdp_cnn")
        load_flat_parameters(model, weights)
        with torch.no_grad():
            return F.cross_entropy(model(images[:300]), labels[:300]).item()

    assert summary["test_loss"] == pytest.approx(test_loss(average), rel=1e-5)
    # At the precision the averaged model's loss is matched to: the seeded run's two losses differ by 5e-4.
    assert summary["test_loss"] != pytest.approx(test_loss(trainer.flat_weights), rel=1e-5)
    _, state = latest_checkpoint(tmp_path / "run")
    torch.testing.assert_close(state["ema_weights"], average)
    torch.testing.assert_close(resume_trainer(str(tmp_path / "run"), show_progress=False).ema_weights, average)


class SampleRecordingTrainer(Trainer):
    """A trainer that records, each step, the workers' shares of the sample and of the next step's sample."""

    def _partial_sums(self, workers, weights, shards, group_shards, next_shards):
        self.seen = getattr(self, "seen", []) + [(shards, group_shards, next_shards)]
        return super()._partial_sums(workers, weights, shards, group_shards, next_shards)


@pytest.mark.parametrize("microbatch_size", [None, 6])
def test_each_step_sends_the_next_steps_sample_each_drawn_from_the_run_key_and_the_step(local_ray, worker_pool,
                                                                                        tmp_path, microbatch_size):
    config = small_config(tmp_path, steps=4, microbatch_size=microbatch_size)
    trainer = SampleRecordingTrainer(config, show_progress=False)
    trainer.run()
    key = process_key(config.seed)  # the seeded run's key; without a seed it lives in the driver's memory only
    expected = []
    for step in range(config.steps):
        sampler = step_generator(key, step)
        indices = poisson_sample(sampler, 600, 0.1)
        groups = assign_microbatches(sampler, len(indices), trainer.plan.microbatches) if microbatch_size else None
        expected.append(worker_shares(indices, groups, 2))
    for step, (shards, group_shards, next_shards) in enumerate(trainer.seen):
        expected_shards, expected_groups = expected[step]
        assert [share.tolist() for share in shards] == [share.tolist() for share in expected_shards]
        assert (group_shards is None) == (microbatch_size is None)
        if microbatch_size:
            assert [share.tolist() for share in group_shards] == [share.tolist() for share in expected_groups]
        if step + 1 < config.steps:
            assert [share.tolist() for share in next_shards] == [share.tolist() for share in expected[step + 1][0]]
        else:
            assert next_shards is None


def test_microbatched_training_runs_on_workers_and_accounts_factor_2(local_ray, worker_pool, tmp_path):
    config = small_config(tmp_path, steps=3, microbatch_size=6)
    summary = Trainer(config, show_progress=False).run()
    expected = get_accountant("pld").epsilon(SampledGaussian(60 / 600, 1.1, 3, sensitivity_factor=2.0), 1e-5)
    assert summary["epsilon"] == expected
    assert all(event["sensitivity_factor"] == 2.0 for event in summary["events"]["events"])


def test_adaptive_clipping_moves_the_clip_norm_and_accounts_the_pair(local_ray, worker_pool, tmp_path):
    config = small_config(tmp_path, steps=6, clip_norm=50.0,
                          adaptive_clipping={"target_quantile": 0.5, "count_noise_multiplier": 3.0})
    summary = Trainer(config, show_progress=False).run()
    # Every example's norm is far below 50, so the noisy fractions near 1 shrink C geometrically.
    assert summary["final_clip_norm"] < 50.0 * 0.95
    sigma = effective_noise_multiplier(1.1, 3.0)
    assert summary["epsilon"] == get_accountant("pld").epsilon(SampledGaussian(60 / 600, sigma, 6), 1e-5)


def test_adaptive_clipping_with_microbatches_counts_microbatches_and_accounts_factor_2(local_ray, worker_pool,
                                                                                      tmp_path):
    # A tiny learning rate keeps the model (and so every microbatch's norm) near its start despite noise 1.1 * 50.
    config = small_config(tmp_path, steps=4, clip_norm=50.0, microbatch_size=6, learning_rate=1e-4,
                          adaptive_clipping={"target_quantile": 0.5, "count_noise_multiplier": 1.0})
    summary = Trainer(config, show_progress=False).run()
    # All 10 microbatches have norms far below 50: fractions near 1 shrink C geometrically.
    assert summary["final_clip_norm"] < 50.0 * 0.95
    expected = SampledGaussian(60 / 600, effective_noise_multiplier(1.1, 1.0), 4, sensitivity_factor=2.0)
    assert summary["epsilon"] == get_accountant("pld").epsilon(expected, 1e-5)


def test_per_layer_clipping_runs_on_workers_with_noise_at_the_total_norm(local_ray, worker_pool, tmp_path):
    config = small_config(tmp_path, steps=4, layer_clip_norms={"0": 0.5, "3": 0.5, "7": 0.5, "9": 0.5})
    trainer = NoiseRecordingTrainer(config, show_progress=False)
    trainer.run()
    assert np.concatenate(trainer.added).std() == pytest.approx(1.1 * 1.0, rel=0.03)


def test_target_epsilon_sets_sigma_that_meets_it(local_ray, worker_pool, tmp_path):
    config = small_config(tmp_path, noise_multiplier=None, target_epsilon=2.0, steps=3)
    summary = Trainer(config, show_progress=False).run()
    assert summary["epsilon"] <= 2.0
    planned = get_accountant("pld").epsilon(SampledGaussian(60 / 600, summary["noise_multiplier"], 3), 1e-5)
    assert planned == summary["epsilon"]


# After the runs above, which share their workers: this run's workers hold 6,000 examples.
def test_one_epoch_on_6k_examples_learns_and_reports_its_epsilon(local_ray, worker_pool, tmp_path):
    config = small_config(
        tmp_path, steps=None, epochs=1, batch_size=100, train_subset=6000, test_subset=None,
        noise_multiplier=0.4, clip_norm=1.0, learning_rate=3.0, max_physical_batch=128,
    )
    summary = Trainer(config, show_progress=False).run()
    assert summary["test_accuracy"] >= 0.85
    # 88% to 91% over four seeds in an in-process sweep of these settings.
    assert summary["steps"] == 60
    expected = get_accountant("pld").epsilon(SampledGaussian(100 / 6000, 0.4, 60), 1e-5)
    assert summary["epsilon"] == expected
    run_dir = tmp_path / "run"
    saved = json.loads((run_dir / "summary.json").read_text())
    for key in ("test_accuracy", "epsilon", "delta", "accountant", "steps", "noise_multiplier", "sampling_rate",
                "clip_norm", "batch_size", "epochs", "workers", "wall_seconds", "samples_per_second"):
        assert key in saved
    assert saved["epsilon"] == expected and saved["workers"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [0, 1]
    # A step's time tracks its realised batch size: timings are the run's, in the summary, never a row's.
    assert all(not {*BREAKDOWN, "wall_seconds"} & set(row) for row in rows)
    driver, worker, wait = (saved[key] for key in BREAKDOWN)
    assert 0 < worker <= wait + 0.005 and driver > 0
    assert 60 * (driver + wait) <= saved["wall_seconds"]
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def write_config(tmp_path, text):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return str(path)


BASE = 'dataset = "mnist"\nmodel = "gdp_cnn"\nsteps = 2\nbatch_size = 10\nnoise_multiplier = 1.0\n'


def test_batchnorm_model_is_refused_with_the_fix(tmp_path, capsys):
    path = write_config(tmp_path, BASE.replace('"gdp_cnn"', '"test_training:batchnorm_cnn"'))
    assert main(["train", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "BatchNorm2d" in err and "BatchNorm1d" in err and "GroupNorm" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        ("clip_norm = -1\n", "clip_norm must be > 0"),
        ("delta = 1.5\n", "delta must be in (0, 1)"),
        ("learning_rate = nan\n", "learning_rate must be a finite number"),
        ("workers = 0\n", "workers must be an integer >= 1"),
        ("epochs = 3\n", "exactly one of epochs"),
        ("target_epsilon = 1.0\n", "exactly one of noise_multiplier"),
        ("train_subset = 5\n", "batch_size (10) must not exceed the dataset size (5)"),
        ("clipnorm = 1\n", "unknown config key(s): clipnorm"),
        ('optimizer = "lbfgs"\n', "optimizer.name must be one of sgd, momentum, adam, adamw"),
        ('optimizer = { name = "adam", momentum = 0.9 }\n', "optimizer 'adam' takes betas, eps, weight_decay"),
        ('model = "resnet"\n', "model must be one of"),
        ('accountant = "moments"\n', "accountant must be one of"),
        ('dataset = "cifar"\n', "dataset must be one of"),
    ],
)
def test_bad_configs_exit_2_naming_the_key(tmp_path, capsys, extra, message):
    text = BASE
    if extra.split("=")[0].strip() in {"model", "dataset"}:
        text = "\n".join(line for line in BASE.splitlines() if not line.startswith(extra.split("=")[0].strip()))
    path = write_config(tmp_path, text + "\n" + extra)
    assert main(["train", "--config", path]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_and_broken_config_files_exit_2(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "absent.toml")]) == 2
    assert main(["train", "--config", write_config(tmp_path, "steps = [")]) == 2
    assert main(["train", "--config", write_config(tmp_path, BASE), "--workers", "-3"]) == 2
    assert "workers must be an integer >= 1" in capsys.readouterr().err


def test_tune_runs_each_trial_as_a_charged_job_and_prices_the_choice_at_all_of_them(local_ray, worker_pool, tmp_path,
                                                                                    capsys):
    base, grid = tmp_path / "base.toml", tmp_path / "grid.toml"
    base.write_text(TINY_JOB.replace("workers = 2", "workers = 1") + "steps = 3\nseed = 2\n")
    grid.write_text("learning_rate = [0.05, 0.5]\n")
    assert main(["tune", "--config", str(base), "--grid", str(grid), "--run-dir", str(tmp_path / "tune"),
                 "--no-progress", "--json"]) == 0
    outcome = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outcome["configurations_tried"] == 2
    assert [trial["overrides"] for trial in outcome["trials"]] == [{"learning_rate": 0.05}, {"learning_rate": 0.5}]
    pld = get_accountant("pld")
    one_trial, both_trials = (pld.epsilon(SampledGaussian(30 / 600, 1.0, steps), 1e-5) for steps in (3, 6))
    assert [trial["epsilon"] for trial in outcome["trials"]] == [pytest.approx(one_trial)] * 2
    assert outcome["selection_epsilon"] == pytest.approx(both_trials, rel=1e-6) and both_trials > one_trial
    assert outcome["best"] == max(outcome["trials"], key=lambda trial: trial["test_accuracy"])
    with open_embedded_ledger() as ledger:
        assert ledger.get_budget("mnist").spent_epsilon == pytest.approx(both_trials, rel=1e-6)
        assert [job.committed_steps for job in ledger.list_jobs()] == [3, 3]
