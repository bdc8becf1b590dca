"""What a model is trained for: its per-example loss and the metrics it is evaluated with.

A loss here is the loss of one example, called with a batch of one
(``loss_fn(model(x_i[None]), y_i[None])``); the clipping engines take each
example's gradient of it. A job names its loss by ``LOSSES`` key or by
``package.module:name``, a function or a module-level loss object: class
weights, ``ignore_index`` and label smoothing come with
``workers.losses.ClassLoss``, ``functools.partial(F.cross_entropy, ...)`` or
``nn.CrossEntropyLoss(...)``, each normalised per example as torch does on a
batch of one (``workers.losses``). Training transforms (torchvision v2) are part
of the mechanism: each sampled example is transformed on its own, in the
worker, before its gradient is taken. Metrics are torchmetrics objects, built by the
workers that evaluate a split in parts and merged by the driver; nothing
here is hand-written metric code.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from workers.clipping import LossFunction
from workers.lazy import LazyModule
from workers.losses import ClassLoss
from workers.models import not_importable
from workers.names import LOSS_NAMES

if TYPE_CHECKING:
    import torchmetrics

# Loaded by the code that evaluates a split or transforms examples, not by the dry run of a model without
# train_transforms: torchmetrics alone takes seconds to import (it loads torchvision's models and scipy.signal).
classification = LazyModule("torchmetrics.classification")
regression = LazyModule("torchmetrics.regression")
v2 = LazyModule("torchvision.transforms.v2")


def _per_example_columns(outputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and labels as [B, k] float columns of the outputs' dtype, so [B], [B, 1] and [B, k] all match."""
    batch = outputs.shape[0]
    return outputs.reshape(batch, -1), labels.reshape(batch, -1).to(outputs.dtype)


def mean_squared_error(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Regression: the mean over the batch and outputs of (output - label)^2; labels [B] or [B, k]."""
    return F.mse_loss(*_per_example_columns(outputs, labels))


def binary_cross_entropy_with_logits(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary (or multi-label) classification on logits [B] or [B, k] against 0/1 labels of the same shape."""
    return F.binary_cross_entropy_with_logits(*_per_example_columns(outputs, labels))


token_cross_entropy = ClassLoss(F.cross_entropy, ignore_index=-100, classes_last=True)
"""Sequence outputs: logits [B, T, V] against token labels [B, T], averaged over the tokens; -100 is ignored."""


LOSSES: dict[str, LossFunction] = {
    "cross_entropy": F.cross_entropy,
    "mse": mean_squared_error,
    "bce_with_logits": binary_cross_entropy_with_logits,
    "token_cross_entropy": token_cross_entropy,
}
"""Built-in losses by name. The two cross-entropies run once over a batch, normalised per example
(``workers.losses.ClassLoss``); the others are evaluated per example by vmap. Their names are ``workers.names.LOSS_NAMES``."""


def build_loss(spec: str) -> LossFunction:
    """The loss named by ``spec``: a ``LOSSES`` key, or ``package.module:function`` taking (outputs, labels)."""
    if spec in LOSSES:
        return LOSSES[spec]
    module_name, _, function_name = spec.partition(":")
    if not (module_name and function_name):
        raise ValueError(f"loss must be one of {', '.join(LOSS_NAMES)} or 'package.module:function' (got {spec!r})")
    try:
        function = getattr(importlib.import_module(module_name), function_name, None)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if not (module_name == missing or module_name.startswith(missing + ".")):
            raise
        raise ValueError(f"loss {spec!r}: {not_importable(module_name)}") from error
    if not callable(function):
        raise ValueError(f"loss {spec!r}: {module_name!r} has no function {function_name!r}")
    return function


def build_metric(name: str, task: str, outputs: torch.Tensor) -> torchmetrics.Metric:
    """A fresh torchmetrics object for ``name``; multiclass metrics take the class count from ``outputs`` [..., C]."""
    if task == "regression":
        return {"mse": regression.MeanSquaredError, "mae": regression.MeanAbsoluteError}[name]()
    if task == "binary":
        return {"accuracy": classification.BinaryAccuracy, "auroc": classification.BinaryAUROC}[name]()
    classes = outputs.shape[-1]
    if name == "auroc":
        return classification.MulticlassAUROC(num_classes=classes)
    top_k = 5 if name == "top5_accuracy" else 1
    return classification.MulticlassAccuracy(num_classes=classes, top_k=min(top_k, classes), average="micro")


def metric_inputs(task: str, outputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(predictions, targets) as torchmetrics takes them: flattened over tokens, probabilities for binary tasks."""
    if task == "regression":
        return _per_example_columns(outputs, labels)
    if task == "binary":
        return torch.sigmoid(outputs.reshape(-1)), labels.reshape(-1).long()
    scores, targets = outputs.reshape(-1, outputs.shape[-1]), labels.reshape(-1).long()
    kept = targets != -100
    return scores[kept], targets[kept]


# Transforms that combine several examples into one: one example would then move several gradients.
CROSS_EXAMPLE_TRANSFORMS = ("MixUp", "CutMix")


def build_transform(steps: Sequence[Mapping[str, Any]]) -> v2.Compose:
    """A torchvision transforms-v2 pipeline from tables ``{ name = "RandomCrop", size = 28, padding = 2 }``.

    Each table names a class of ``torchvision.transforms.v2`` and gives its
    keyword arguments. The pipeline is applied to one example at a time, so
    each example still yields one clipped gradient; transforms that mix
    examples are refused.
    """
    built = []
    for position, step in enumerate(steps):
        if not isinstance(step, Mapping) or not isinstance(step.get("name"), str):
            raise ValueError(f"train_transforms[{position}] must be a table with a 'name' key (got {step!r})")
        arguments = {key: value for key, value in step.items() if key != "name"}
        name = step["name"]
        if name in CROSS_EXAMPLE_TRANSFORMS:
            raise ValueError(
                f"train_transforms[{position}]: {name} mixes examples, so one example would move several "
                "clipped gradients; use per-example transforms only (e.g. RandomCrop, RandomHorizontalFlip)"
            )
        transform_class = getattr(v2, name, None)
        if not (isinstance(transform_class, type) and issubclass(transform_class, v2.Transform)):
            raise ValueError(f"train_transforms[{position}]: {name!r} is not a torchvision.transforms.v2 transform")
        try:
            built.append(transform_class(**arguments))
        except (TypeError, ValueError) as error:
            raise ValueError(f"train_transforms[{position}] ({name}): {error}") from None
    return v2.Compose(built)


def transform_each(transform: v2.Compose, inputs: torch.Tensor) -> torch.Tensor:
    """``transform`` applied to each example of ``inputs`` [B, ...] on its own, with its own random draws."""
    if not len(inputs):
        return inputs
    return torch.stack([transform(example) for example in inputs])


def augmented_views(transform: v2.Compose, inputs: torch.Tensor, views: int) -> torch.Tensor:
    """``views`` K independent transforms of each example: [B, ...] for K = 1, else [B, K, ...]."""
    if views == 1:
        return transform_each(transform, inputs)
    return torch.stack([transform_each(transform, inputs) for _ in range(views)], dim=1)
