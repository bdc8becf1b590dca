"""Pictures of a run: test accuracy and epsilon against epochs."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first


def plot_curves(metrics: list[dict], path: Path, epsilon_label: str) -> None:
    """Write a PNG with test accuracy (left) and epsilon spent (right) per epoch (epoch 0 = before training)."""
    epochs = [row["epoch"] for row in metrics]
    figure, (accuracy_axis, epsilon_axis) = plt.subplots(1, 2, figsize=(9, 3.5))
    accuracy_axis.plot(epochs, [100 * row["test_accuracy"] for row in metrics], marker="o")
    accuracy_axis.set(xlabel="epoch", ylabel="test accuracy (%)", title="Test accuracy")
    accuracy_axis.grid(alpha=0.3)
    epsilon_axis.plot(epochs, [row["epsilon"] for row in metrics], marker="o", color="tab:red")
    epsilon_axis.set(xlabel="epoch", ylabel="epsilon", title=epsilon_label)
    epsilon_axis.grid(alpha=0.3)
    for axis in (accuracy_axis, epsilon_axis):
        axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
