"""Pictures of a run: a test metric and epsilon against epochs."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first


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
