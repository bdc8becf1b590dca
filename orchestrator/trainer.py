"""The DP-SGD driver: sample, fan out to workers, sum, add noise once, step.

The data flows one way: the driver Poisson-samples each logical batch and
splits its indices across the gradient workers; each worker returns the sum of
its examples' clipped gradients; the driver adds up the partial sums, adds
Gaussian noise N(0, (sigma * C)^2) once, divides by the expected batch size,
steps the optimizer and ships the new weights with the next step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import ray
import torch
import torch.nn.functional as F
from tqdm import tqdm

from accounting.accountants import get_accountant, label
from accounting.calibration import noise_multiplier_for
from accounting.events import Composition, SampledGaussian
from orchestrator.config import TrainConfig, expected_batch_size, sampling_rate, total_steps, training_set_size
from orchestrator.noise import GaussianNoise, noisy_mean_gradient
from orchestrator.optimizers import build_optimizer
from orchestrator.report import plot_curves
from orchestrator.sampling import make_generator, partition, poisson_sample
from workers.actor import GradientWorkerActor
from workers.data import load_split
from workers.models import build_model, flat_parameters, load_flat_gradient
from workers.validation import check_model

SAMPLER_STREAM = 0
_EVALUATION_BATCH = 1000
_TRAIN_LOSS_EXAMPLES = 10_000


@dataclass(frozen=True)
class RunPlan:
    """What a configuration will run: derived once, before any worker starts."""

    dataset_size: int
    sampling_rate: float
    expected_batch_size: float
    steps: int
    noise_multiplier: float
    epoch_ends: tuple[int, ...]

    def step_event(self, steps: int = 1) -> SampledGaussian:
        """The DP event of `steps` steps of this run."""
        return SampledGaussian(self.sampling_rate, self.noise_multiplier, steps)

    @property
    def planned_events(self) -> Composition:
        """The events of the whole planned run."""
        return Composition((self.step_event(self.steps),))


def plan_run(config: TrainConfig) -> RunPlan:
    """Derive N, q, steps, sigma (from target_epsilon if asked) and the epoch boundaries."""
    dataset_size = training_set_size(config)
    rate = sampling_rate(config)
    steps = total_steps(config)
    noise_multiplier = config.noise_multiplier
    if noise_multiplier is None:
        noise_multiplier = noise_multiplier_for(config.target_epsilon, config.delta, rate, steps, config.accountant)
    steps_per_epoch = dataset_size / config.batch_size
    epoch_ends = sorted({min(steps, math.ceil(epoch * steps_per_epoch - 1e-9))
                         for epoch in range(1, math.ceil(steps / steps_per_epoch - 1e-9) + 1)} | {steps})
    return RunPlan(dataset_size, rate, expected_batch_size(config), steps, noise_multiplier, tuple(epoch_ends))


def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of `model` on (images, labels)."""
    model.eval()
    total_loss, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(labels), _EVALUATION_BATCH):
            logits = model(images[start : start + _EVALUATION_BATCH])
            batch_labels = labels[start : start + _EVALUATION_BATCH]
            total_loss += F.cross_entropy(logits, batch_labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == batch_labels).sum().item()
    model.train()
    return total_loss / len(labels), correct / len(labels)


def start_ray(config: TrainConfig) -> bool:
    """Connect to RAY_ADDRESS if set, else start a local Ray sized for the workers.

    Returns True when this call started Ray (and so should shut it down).
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        return True
    cpus = max(os.cpu_count() or 1, config.workers * config.cpus_per_worker)
    gpus = torch.cuda.device_count() if config.gpus_per_worker else 0
    ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, log_to_driver=True)
    return True


class Trainer:
    """One DP-SGD run over Ray gradient workers.

    `noise` replaces the driver's noise source (tests observe it);
    `on_block` is called with the events of each block of steps before the
    block runs (the ledger charges there).
    """

    def __init__(
        self,
        config: TrainConfig,
        noise: GaussianNoise | None = None,
        show_progress: bool = True,
        show_train_loss: bool = False,
        on_block: Callable[[Composition], None] | None = None,
        out=sys.stdout,
    ):
        self.config = config
        self.plan = plan_run(config)
        self.noise = noise or GaussianNoise(config.seed)
        self.sampler = make_generator(config.seed, SAMPLER_STREAM)
        self.show_progress = show_progress
        self.show_train_loss = show_train_loss
        self.on_block = on_block
        self.out = out
        self.accountant = get_accountant(config.accountant)
        self.model = build_model(config.model)
        check_model(self.model)
        self.optimizer = build_optimizer(config.optimizer, config.learning_rate, self.model.parameters())
        self.events = Composition()
        self.run_dir = Path(config.run_dir)

    def epsilon(self) -> float:
        """Epsilon of the steps run so far, at the config's delta, by the config's accountant."""
        return self.accountant.epsilon(self.events, self.config.delta)

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def run(self) -> dict:
        """Train for the planned steps and return the summary (also written to run_dir)."""
        config, plan = self.config, self.plan
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True))
        if config.seed is not None:
            self._say(f"seeded: not for production use (seed {config.seed})")
        self._say(
            f"dpfleet: {config.model} on {config.dataset} (N={plan.dataset_size}), {plan.steps} steps, "
            f"q={plan.sampling_rate:.4g}, sigma={plan.noise_multiplier:.4g}, C={config.clip_norm:g}, "
            f"{config.workers} worker(s)"
        )
        test_images, test_labels = load_split(config.dataset, "test", config.data_root)
        if config.test_subset is not None:
            test_images, test_labels = test_images[: config.test_subset], test_labels[: config.test_subset]
        train_probe = self._train_probe()
        started_ray = start_ray(config)
        try:
            workers = self._start_workers()
            metrics = self._train(workers, test_images, test_labels, train_probe)
        finally:
            if started_ray:
                ray.shutdown()
        return self._finish(metrics)

    def _train_probe(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.show_train_loss:
            return None
        images, labels = load_split(self.config.dataset, "train", self.config.data_root)
        limit = min(_TRAIN_LOSS_EXAMPLES, self.plan.dataset_size)
        return images[:limit], labels[:limit]

    def _start_workers(self) -> list:
        config = self.config
        workers = [
            GradientWorkerActor.options(num_cpus=config.cpus_per_worker, num_gpus=config.gpus_per_worker).remote(
                config.model,
                config.dataset,
                config.train_subset,
                config.max_physical_batch,
                threads=config.cpus_per_worker,
                data_root=config.data_root,
            )
            for _ in range(config.workers)
        ]
        ray.get([worker.ping.remote() for worker in workers])
        return workers

    def _step(self, workers: list) -> None:
        """One DP-SGD step: sample, fan out, sum, noise once, average, optimizer step."""
        config, plan = self.config, self.plan
        indices = poisson_sample(self.sampler, plan.dataset_size, plan.sampling_rate)
        weights = ray.put(flat_parameters(self.model).numpy())
        partial_sums = ray.get(
            [
                worker.clipped_grad_sum.remote(weights, shard, config.clip_norm)
                for worker, shard in zip(workers, partition(indices, len(workers)))
            ]
        )
        clipped_sum = np.add.reduce(partial_sums, dtype=np.float64)
        noise = self.noise.draw(clipped_sum.size, plan.noise_multiplier * config.clip_norm)
        gradient = noisy_mean_gradient(clipped_sum, noise, plan.expected_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        load_flat_gradient(self.model, gradient)
        self.optimizer.step()
        self.events = self.events.then(plan.step_event())

    def _train(self, workers, test_images, test_labels, train_probe) -> list[dict]:
        plan, config = self.plan, self.config
        metrics: list[dict] = []
        metrics_path = self.run_dir / "metrics.jsonl"
        self.started = time.perf_counter()
        metrics.append(self._epoch_metrics(0, 0, test_images, test_labels, train_probe))
        metrics_path.write_text(json.dumps(metrics[-1], sort_keys=True) + "\n")
        step = 0
        for epoch, epoch_end in enumerate(plan.epoch_ends, start=1):
            block = epoch_end - step
            if self.on_block is not None:
                self.on_block(Composition((plan.step_event(block),)))
            bar = tqdm(
                total=block,
                desc=f"epoch {epoch}/{len(plan.epoch_ends)}",
                unit="step",
                disable=not self.show_progress,
                file=sys.stderr,
                dynamic_ncols=True,
            )
            epoch_started = time.perf_counter()
            refresh_every = max(1, block // 4)
            for index in range(block):
                self._step(workers)
                bar.update(1)
                if (index + 1) % refresh_every == 0:
                    elapsed = time.perf_counter() - epoch_started
                    bar.set_postfix(
                        eps=f"{self.epsilon():.3f}",
                        samples_s=f"{(index + 1) * plan.expected_batch_size / elapsed:.0f}",
                    )
            bar.close()
            step = epoch_end
            metrics.append(self._epoch_metrics(epoch, step, test_images, test_labels, train_probe))
            with metrics_path.open("a") as handle:
                handle.write(json.dumps(metrics[-1], sort_keys=True) + "\n")
            self._say(self._epoch_line(metrics[-1]))
        return metrics

    def _epoch_metrics(self, epoch, step, test_images, test_labels, train_probe) -> dict:
        test_loss, test_accuracy = evaluate(self.model, test_images, test_labels)
        row = {
            "epoch": epoch,
            "step": step,
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
            "epsilon": self.epsilon(),
            "wall_seconds": time.perf_counter() - self.started,
        }
        if train_probe is not None:
            row["train_loss_non_private"] = evaluate(self.model, *train_probe)[0]
        return row

    def _epoch_line(self, row: dict) -> str:
        line = (
            f"epoch {row['epoch']}: test accuracy {row['test_accuracy']:.4f}, test loss {row['test_loss']:.4f}, "
            f"epsilon {row['epsilon']:.4f} ({label(self.accountant)}, delta={self.config.delta:g})"
        )
        if "train_loss_non_private" in row:
            line += f", train loss {row['train_loss_non_private']:.4f} (non-private)"
        return line

    def _finish(self, metrics: list[dict]) -> dict:
        config, plan = self.config, self.plan
        wall_seconds = time.perf_counter() - self.started
        last = metrics[-1]
        summary = {
            "test_accuracy": last["test_accuracy"],
            "test_loss": last["test_loss"],
            "epsilon": self.epsilon(),
            "epsilon_rigorous": self.accountant.rigorous,
            "delta": config.delta,
            "accountant": config.accountant,
            "steps": self.events.steps,
            "noise_multiplier": plan.noise_multiplier,
            "sampling_rate": plan.sampling_rate,
            "clip_norm": config.clip_norm,
            "batch_size": config.batch_size,
            "epochs": self.events.steps * config.batch_size / plan.dataset_size,
            "dataset": config.dataset,
            "dataset_size": plan.dataset_size,
            "model": config.model,
            "workers": config.workers,
            "wall_seconds": wall_seconds,
            # From the expected batch size: the realised sizes are raw counts and stay inside the driver.
            "samples_per_second": self.events.steps * plan.expected_batch_size / wall_seconds,
            "seeded": config.seed is not None,
            "events": self.events.to_dict(),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
        plot_curves(metrics, self.run_dir / "curves.png", f"{label(self.accountant)} epsilon at delta={config.delta:g}")
        return summary
