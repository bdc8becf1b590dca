"""What a run tells its reader: the log lines, the progress bar, metrics.jsonl, the summary and the curves.

Everything here is post-processing of noisy sums and of the accounted events:
the realised batch sizes and other raw counts never reach it. Timings are of
whole steps, averaged over the run, never per metrics row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import matplotlib
import matplotlib.ticker
from tqdm import tqdm

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

from accounting.accountants import get_accountant, label, labelled_epsilon  # noqa: E402
from accounting.calibration import scale_for_target  # noqa: E402
from accounting.events import Composition, SampledGaussian, event_of, group_events  # noqa: E402
from accounting.matrix_mechanisms import banded_prefix_rmse  # noqa: E402
from orchestrator.config import TrainConfig  # noqa: E402
from orchestrator import release  # noqa: E402
from orchestrator.planning import RunPlan  # noqa: E402
from orchestrator.run_record import RunRecord  # noqa: E402
from workers.pretrained_spec import describe_model  # noqa: E402
from workers.sources import spec_name  # noqa: E402


class RunReport:
    """The run's reader-facing output: ε as the config's accountant reports it, the log, the bar and the files.

    `say` prints one log line; `show_progress` turns the per-epoch progress
    bar on (on stderr).
    """

    def __init__(self, config: TrainConfig, plan: RunPlan, say: Callable[[str], None], show_progress: bool):
        self.config, self.plan, self.say, self.show_progress = config, plan, say, show_progress
        self.run_dir = Path(config.run_dir)
        self.accountant = get_accountant(config.accountant)
        self.epsilon_label = label(self.accountant)

    def epsilon(self, events: Composition) -> float:
        """Epsilon of `events` at the config's delta; also sets ``epsilon_label``, how it was obtained."""
        value, self.epsilon_label = labelled_epsilon(self.accountant, events, self.config.delta)
        return value

    def start(self, step: int) -> None:
        """Write config.json and say what runs: the model, the data, N, q, sigma, C and where a resume starts."""
        config, plan = self.config, self.plan
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(release.record("config.json", config.to_dict()),
                                                             indent=2, sort_keys=True))
        if config.seed is not None:
            self.say(release.line("seeded", seed=config.seed))
        self.say(release.line(
            "run_start", model=describe_model(config.model_spec),
            data=f"{len(config.shards)} shards" if config.shards else spec_name(config.dataset),
            size=f"N={plan.dataset_size}" if plan.privacy_unit == "example" else f"{plan.dataset_size} users",
            steps=plan.steps, sampling_rate=f"{plan.sampling_rate:.4g}", sigma=f"{plan.noise_multiplier:.4g}",
            clip_norm=f"{config.clip_norm:g}", workers=config.workers,
            resuming=f", resuming at step {step}" if step else ""))

    def progress_bar(self, epoch: int, steps: int) -> tqdm:
        """The bar of epoch `epoch` (1-based), over its `steps` remaining steps: steps done and ε, never a time.

        A rate or an estimate of the time left, redrawn every few steps,
        would give the time of the steps between two redraws, which tracks
        their batch sizes (docs/threat-model.md).
        """
        return tqdm(total=steps, desc=f"epoch {epoch}/{len(self.plan.epoch_ends)}", unit="step",
                    disable=not self.show_progress, file=sys.stderr, dynamic_ncols=True,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps{postfix}")

    def add_row(self, metrics: list[dict], row: dict) -> None:
        """Append `row` to `metrics`, rewrite metrics.jsonl, and log its line unless it is the row before training."""
        metrics.append(release.record("metrics.jsonl", row, shown={"train_loss_non_private"}))
        (self.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in metrics))
        if row["epoch"]:
            self.say(self.epoch_line(row))

    def epoch_line(self, row: dict) -> str:
        """The log line of a metrics row: its test figures and ε."""
        figures = ", ".join(f"test {name.replace('_', ' ')} {row[f'test_{name}']:.4f}"
                            for name in (*self.config.metrics, "loss"))
        values = dict(epoch=f"{row['epoch']:.4g}", figures=figures, epsilon=f"{row['epsilon']:.4f}",
                      label=self.epsilon_label + self.unit_label(), delta=f"{self.config.delta:g}")
        if "train_loss_non_private" in row:
            return release.line("epoch_train_loss", shown=True, train_loss=f"{row['train_loss_non_private']:.4f}",
                                **values)
        return release.line("epoch", **values)

    def unit_label(self) -> str:
        """", per user" when ε protects each user rather than each row."""
        return ", per user" if self.plan.privacy_unit == "user" else ""

    def finish(self, record: RunRecord, reservation_id: str | None) -> dict:
        """The summary of the run that `record` describes, written to summary.json with the curves in curves.png."""
        config, plan, events, steps = self.config, self.plan, record.events, record.step
        wall_seconds = record.wall_seconds()
        summary = {
            **{key: value for key, value in record.metrics[-1].items() if key.startswith("test_")},
            "loss": config.loss,
            "epsilon": self.epsilon(events),
            "epsilon_label": self.epsilon_label,
            "epsilon_rigorous": self.accountant.rigorous,
            "delta": config.delta,
            "accountant": config.accountant,
            "steps": steps,
            "noise_multiplier": plan.noise_multiplier,
            "sampling_rate": plan.sampling_rate,
            "clip_norm": config.clip_norm,
            "final_clip_norm": record.clip_norm,
            "batch_size": config.batch_size,
            "epochs": steps * config.batch_size / plan.dataset_size,
            "dataset": spec_name(config.dataset),
            "dataset_size": plan.dataset_size,
            "model": config.model,
            "workers": config.workers,
            "wall_seconds": wall_seconds,
            # From the expected batch size: the realised sizes are raw counts and stay inside the driver.
            "samples_per_second": record.times.steps * plan.expected_batch_size / wall_seconds,
            # Means over the steps of this start: like wall_seconds, timings of whole steps, never of one example.
            **record.times.per_step(),
            "seeded": config.seed is not None,
            "reservation_id": reservation_id,
            "events": events.to_dict(),
        }
        summary |= self._person_epsilons(events)
        summary |= self._mechanism_figures(summary["epsilon"], steps)
        if config.early_stopping_patience is not None:
            # Whether the test metric stopped the run before its planned steps (the rest were released, not charged).
            summary["stopped_early"] = steps < plan.steps
            summary["planned_steps"] = plan.steps
        if config.shards:
            summary["shards"] = len(config.shards)
            summary["shard_outages"] = record.shard_outages
        if config.secure_aggregation:
            summary |= self._noise_placement_figures(events)
        release.record("summary.json", summary)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
        plot_curves(record.metrics, self.run_dir / "curves.png",
                    f"{self.epsilon_label} epsilon at delta={config.delta:g}", config.metrics[0])
        return summary

    def _noise_placement_figures(self, events: Composition) -> dict:
        """Where the noise was added; with the silos' noise shares, also the ε that Gaussian
        noise of the same σ added by the driver would give the same steps (what the noise in shares costs): by the
        config's accountant, and by RDP, the Skellam bound's own kind."""
        config = self.config
        figures: dict = {"noise_placement": config.noise_placement}
        if config.noise_placement == "silos":
            driver_events = Composition(tuple(event_of(event.mechanism_key[:3], event.steps)
                                              for event in events.events))
            figures["driver_noise_epsilon"], figures["driver_noise_epsilon_label"] = labelled_epsilon(
                self.accountant, driver_events, config.delta)
            figures["driver_noise_epsilon_rdp"] = get_accountant("rdp").epsilon(driver_events, config.delta)
        return figures

    def _mechanism_figures(self, epsilon: float, steps: int) -> dict:
        """A correlated mechanism's figures: its settings, and the RMSE of its prefix sums beside DP-SGD's at the
        same ε (σ calibrated for Poisson sampling at the run's q and steps), per coordinate in clip norms."""
        correlation, plan, config = self.plan.correlation, self.plan, self.config
        if correlation is None or steps == 0:
            return {}
        dp_sgd_sigma = scale_for_target(epsilon, config.delta, lambda sigma: SampledGaussian(
            plan.sampling_rate, sigma, steps), config.accountant)
        return {
            "mechanism": correlation.mechanism, "sampler": correlation.sampler,
            "band_width": correlation.band_width if correlation.mechanism == "band-mf" else None,
            "participations": -(-steps // correlation.period),
            "prefix_rmse": correlation.prefix_rmse(plan.noise_multiplier),
            "dp_sgd_prefix_rmse_same_epsilon": banded_prefix_rmse([1.0], steps, 1.0, dp_sgd_sigma),
        }

    def _person_epsilons(self, events: Composition) -> dict:
        """The summary's figures for a row under user-level privacy, and for a person of several rows."""
        config, plan, figures = self.config, self.plan, {}
        if plan.privacy_unit == "user":
            # Each user's ε is `epsilon`; what one row reveals is bounded by the events the ledger was charged.
            figures["privacy_unit"] = "user"
            figures["users"] = plan.dataset_size
            figures["row_epsilon"] = labelled_epsilon(self.accountant, plan.row_level_events_between(0, events.steps),
                                                      config.delta)[0]
        if plan.rows_per_person is not None:
            # Group privacy: what the events so far reveal about a person of at most this many rows.
            figures["rows_per_person"] = plan.rows_per_person
            figures["user_epsilon"] = labelled_epsilon(self.accountant, group_events(events, plan.rows_per_person),
                                                       config.delta)[0]
        return figures


def plot_curves(metrics: list[dict], path: Path, epsilon_label: str, metric: str = "accuracy") -> None:
    """Write a PNG with the test ``metric`` (left) and epsilon spent (right) per epoch (epoch 0 = before training).

    Accuracy-like metrics (accuracy, AUROC) are shown in percent.
    """
    epochs = [row["epoch"] for row in metrics]
    figure, (metric_axis, epsilon_axis) = plt.subplots(1, 2, figsize=(9, 3.5))
    percent = metric in ("accuracy", "top5_accuracy", "auroc")
    title = metric.replace("_", " ") if metric != "auroc" else "AUROC"
    metric_axis.plot(epochs, [(100 if percent else 1) * row[f"test_{metric}"] for row in metrics], marker="o")
    metric_axis.set(xlabel="epoch", ylabel=f"test {title}{' (%)' if percent else ''}", title=f"Test {title}")
    metric_axis.grid(alpha=0.3)
    epsilon_axis.plot(epochs, [row["epsilon"] for row in metrics], marker="o", color="tab:red")
    epsilon_axis.set(xlabel="epoch", ylabel="epsilon", title=epsilon_label)
    epsilon_axis.grid(alpha=0.3)
    for axis in (metric_axis, epsilon_axis):
        axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
