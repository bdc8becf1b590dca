"""The names a job may give its model, clipping engine, loss and metrics: the workers' registries, without torch.

A config is checked against these names before anything runs (and by
commands that only plan a job, such as ``dpfleet ledger fits``), so they
live here, apart from the torch code they name: ``workers.models``,
``workers.engines`` and ``workers.tasks`` register their functions under
exactly these names, and tests/test_registry_names.py holds each registry
to its list.
"""

from __future__ import annotations

from collections.abc import Sequence

MODEL_NAMES: tuple[str, ...] = (
    "gdp_cnn",
    "lenet5",
    "opacus_cnn",
    "scatternet_cnn",
    "scatternet_cnn_32",
    "scatternet_linear",
    "scatternet_linear_32",
)
"""Built-in models (``workers.models``), sorted; a job may also name a ``package.module:function`` factory."""

ENGINE_NAMES: tuple[str, ...] = ("fast", "vmap")
"""Clipping engines (``workers.engines.ENGINES``): "fast" (book-keeping, the default) and "vmap" (the reference)."""

PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
"""What a clipping engine's forward and backward passes compute in (``workers.clipping.autocast_for``)."""

LOSS_NAMES: tuple[str, ...] = ("cross_entropy", "mse", "bce_with_logits", "token_cross_entropy")
"""Built-in per-example losses (``workers.tasks.LOSSES``); a job may also name a ``package.module:function``."""

TASK_OF_LOSS = {
    "cross_entropy": "multiclass",
    "token_cross_entropy": "multiclass",
    "bce_with_logits": "binary",
    "mse": "regression",
}
METRICS = {
    "multiclass": ("accuracy", "top5_accuracy", "auroc"),
    "binary": ("accuracy", "auroc"),
    "regression": ("mse", "mae"),
}
DEFAULT_METRICS = {"multiclass": ("accuracy",), "binary": ("accuracy", "auroc"), "regression": ("mse", "mae")}


def task_of(loss: str) -> str:
    """"multiclass", "binary" or "regression": what the metrics of a loss compare; a custom loss counts as multiclass."""
    return TASK_OF_LOSS.get(loss, "multiclass")


def check_metrics(loss: str, metrics: Sequence[str] | None) -> tuple[str, ...]:
    """The metrics to report for ``loss``: ``metrics`` if each fits its task, else the task's defaults when None."""
    task = task_of(loss)
    if metrics is None:
        return DEFAULT_METRICS[task]
    unfit = [name for name in metrics if name not in METRICS[task]]
    if unfit:
        raise ValueError(
            f"metrics {', '.join(map(repr, unfit))} do not fit a {task} task (loss {loss!r}); "
            f"choose from {', '.join(METRICS[task])}"
        )
    return tuple(metrics)
