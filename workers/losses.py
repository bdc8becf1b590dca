"""Each example's loss exactly as the job's loss defines it on a batch of one.

The clipping engines differentiate ``per_example_losses``: entry i is
``loss_fn(outputs[i:i+1], labels[i:i+1])``. Averaging a batched
``reduction="none"`` loss over every position is not that loss when some
positions do not count: torch's cross-entropy on one example averages over
the positions whose label is not ``ignore_index``, weighted by the class
``weight`` of each position's label, and label smoothing shares that
denominator. A padded sequence would otherwise train on (valid positions ÷ T)
of its loss.

torch's cross-entropy and negative log-likelihood, however they are given
(``F.cross_entropy``, ``F.nll_loss``, ``functools.partial`` of either with
keyword options, ``nn.CrossEntropyLoss``, ``nn.NLLLoss``, ``ClassLoss``), run
once over the batch and are normalised per example (``ClassLoss.per_example``).
Any other loss is evaluated on each example as a batch of one: by vmap, or one
example at a time when torch.func cannot batch it.

An example with nothing to average over (every position ignored, or a total
class weight of zero) has no loss to learn from: torch gives NaN (0/0) on a
batch of one, and here its loss is 0 with a zero gradient, so it adds exactly
nothing to the clipped sum and counts as a finite example. A loss the engines
do not recognise keeps torch's NaN; the engines then leave that example out
(exactly zero), as for any non-finite gradient.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap

from workers.clipping import LossFunction

# The keyword options of F.cross_entropy and F.nll_loss that a ClassLoss reproduces per example.
_CROSS_ENTROPY_OPTIONS = frozenset({"weight", "ignore_index", "reduction", "label_smoothing"})
_NLL_OPTIONS = frozenset({"weight", "ignore_index", "reduction"})
# A reduction over a batch of one that yields one number.
_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True, eq=False)
class ClassLoss:
    """torch's cross-entropy (``F.cross_entropy``) or negative log-likelihood (``F.nll_loss``) with its options.

    Called on a batch it is the torch function with these options. Outputs
    are [B, C, ...] as torch takes them, or with ``classes_last`` [B, ..., C]
    (a language model's logits [B, T, V]). ``weight`` [C] is cast to the
    outputs' dtype and device. A job may name a module-level ``ClassLoss`` as
    its loss (``package.module:name``) to get class weights or label smoothing.
    """

    function: LossFunction = F.cross_entropy
    weight: Tensor | None = None
    ignore_index: int = -100
    label_smoothing: float = 0.0
    reduction: str = "mean"
    classes_last: bool = False

    def __post_init__(self) -> None:
        if self.function not in (F.cross_entropy, F.nll_loss):
            raise ValueError(f"ClassLoss takes F.cross_entropy or F.nll_loss (got {self.function!r})")
        if self.reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS} (got {self.reduction!r}): the loss of a "
                             "batch of one must be one number")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must lie in [0, 1] (got {self.label_smoothing})")
        if self.label_smoothing and self.function is F.nll_loss:
            raise ValueError("label_smoothing is an option of F.cross_entropy, not F.nll_loss")

    def __call__(self, outputs: Tensor, labels: Tensor) -> Tensor:
        """The loss of the batch, as the torch function defines it with these options."""
        return self._torch_loss(outputs, labels, self.reduction)

    def _torch_loss(self, outputs: Tensor, labels: Tensor, reduction: str) -> Tensor:
        if self.classes_last:
            outputs = outputs.movedim(-1, 1)
            labels = labels.movedim(-1, 1) if labels.is_floating_point() else labels
        options = {"weight": self._weight_for(outputs), "ignore_index": self.ignore_index, "reduction": reduction}
        if self.function is F.cross_entropy:
            options["label_smoothing"] = self.label_smoothing
        return self.function(outputs, labels, **options)

    def _weight_for(self, outputs: Tensor) -> Tensor | None:
        return None if self.weight is None else self.weight.to(device=outputs.device, dtype=outputs.dtype)

    def per_example(self, outputs: Tensor, labels: Tensor) -> Tensor:
        """Each example's loss [B], equal to this loss on that example alone; 0 for one with nothing to average.

        torch's "mean" divides the summed position losses (class-weighted,
        label smoothing included) by the summed class weights of the counted
        positions' labels (their count without ``weight``); class
        probabilities as labels divide by the number of positions.
        """
        batch = outputs.shape[0]
        summed = self._torch_loss(outputs, labels, "none").reshape(batch, -1).sum(1)
        if self.reduction == "sum":
            return summed
        if labels.is_floating_point():
            return summed / _positions(outputs, self._class_dim(outputs))
        counted = (labels != self.ignore_index).reshape(batch, -1)
        if self.weight is None:
            normaliser = counted.to(summed.dtype).sum(1)
        else:
            classes = outputs.shape[self._class_dim(outputs)]
            label_weights = self._weight_for(outputs)[labels.reshape(batch, -1).clamp(0, classes - 1)]
            normaliser = torch.where(counted, label_weights, 0).sum(1)
        has_weight = normaliser > 0
        # Both branches are finite, so the example with nothing to average gets a zero gradient, not 0 * inf.
        return torch.where(has_weight, summed / torch.where(has_weight, normaliser, 1), 0)

    def _class_dim(self, outputs: Tensor) -> int:
        return outputs.dim() - 1 if self.classes_last else 1


def _positions(outputs: Tensor, class_dim: int) -> int:
    """How many positions (entries apart from the batch and the classes) one example's outputs have."""
    return max(1, outputs[0].numel() // outputs.shape[class_dim]) if outputs.shape[0] else 1


def class_loss_of(loss_fn: LossFunction) -> ClassLoss | None:
    """``loss_fn`` as a ClassLoss when it is torch's cross-entropy or NLL with options a ClassLoss has, else None."""
    if isinstance(loss_fn, ClassLoss):
        return loss_fn
    if loss_fn in (F.cross_entropy, F.nll_loss):
        return ClassLoss(loss_fn)
    if isinstance(loss_fn, functools.partial) and loss_fn.func in (F.cross_entropy, F.nll_loss) and not loss_fn.args:
        options = _CROSS_ENTROPY_OPTIONS if loss_fn.func is F.cross_entropy else _NLL_OPTIONS
        if set(loss_fn.keywords) <= options and loss_fn.keywords.get("reduction", "mean") in _REDUCTIONS:
            return ClassLoss(loss_fn.func, **loss_fn.keywords)
        return None
    if type(loss_fn) in (nn.CrossEntropyLoss, nn.NLLLoss) and loss_fn.reduction in _REDUCTIONS:
        function = F.cross_entropy if type(loss_fn) is nn.CrossEntropyLoss else F.nll_loss
        return ClassLoss(function, loss_fn.weight, loss_fn.ignore_index, getattr(loss_fn, "label_smoothing", 0.0),
                         loss_fn.reduction)
    return None


def per_example_losses(loss_fn: LossFunction, outputs: Tensor, labels: Tensor) -> Tensor:
    """Each example's loss [B], as ``loss_fn(outputs[i:i+1], labels[i:i+1])`` defines it (see the module's notes).

    Differentiable, and usable inside torch.func transforms (the vmap engine
    calls it on a batch of one per example).
    """
    known = class_loss_of(loss_fn)
    if known is not None:
        return known.per_example(outputs, labels)
    batch = outputs.shape[0]
    if batch == 1:
        return _one_number(loss_fn(outputs, labels)).reshape(1)
    if batch == 0:
        return outputs.new_zeros(0)
    try:
        losses = vmap(lambda output, label: loss_fn(output.unsqueeze(0), label.unsqueeze(0)))(outputs, labels)
    except (RuntimeError, NotImplementedError):
        # torch.func cannot batch this loss (data-dependent shapes, .item(), random draws): one example at a time.
        return torch.stack([
            _one_number(loss_fn(outputs[index : index + 1], labels[index : index + 1])).reshape(())
            for index in range(batch)
        ])
    _one_number(losses[0])
    return losses.reshape(batch)


def _one_number(loss: Tensor) -> Tensor:
    """``loss`` if it holds one number, else ValueError: what a batch of one must give to be differentiated."""
    if loss.numel() != 1:
        raise ValueError(f"a loss must give one number for a batch of one example (got shape {tuple(loss.shape)}); "
                         "reduce it, e.g. with reduction='mean' or 'sum'")
    return loss
