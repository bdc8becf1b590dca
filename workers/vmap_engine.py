"""The vmap clipping engine: per-example gradients by torch.func, the reference the fast engine is checked against.

``per_example_clipped_sum`` clips each example's whole gradient;
``microbatch_clipped_sum`` clips each microbatch's mean gradient. Both use the
clip arithmetic of ``workers.clipping`` and run in IEEE float32.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from workers.clipping import (
    ClipNorm,
    LossFunction,
    autocast_for,
    check_arguments,
    clip_factors,
    clip_factors_by_parameter,
    device_of,
    functional_parameters,
    in_ieee_float32,
    without_non_finite,
)
from workers.losses import class_loss_of, per_example_losses
from workers.recurrent import unrolled_recurrences
from workers.validation import keeps_buffers


@keeps_buffers
@in_ieee_float32
def microbatch_clipped_sum(
    model: nn.Module,
    flat_weights: torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    group_ids: torch.Tensor,
    clip_norm: float,
    loss_fn: LossFunction = F.cross_entropy,
    return_norms: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sum over microbatches of the gradient of each microbatch's mean loss, clipped to L2 norm ``clip_norm``.

    ``group_ids`` [n] assigns each example to its microbatch (TF Privacy's and
    MindArmour's microbatches). Adding or removing one example changes one
    microbatch, whose clipped gradient can move by up to 2 * clip_norm: the
    caller accounts with sensitivity factor 2. Same layout and zeros-when-empty
    contract as ``per_example_clipped_sum``. A member whose own gradient is not
    finite is left out of its microbatch, which is then exactly the microbatch
    without it. With ``return_norms`` it also returns the unclipped norm of
    each non-empty microbatch's gradient [groups] and the number of examples
    left out (a raw count, for the driver only).
    """
    check_arguments(model, flat_weights, inputs, labels, clip_norm, max_physical_batch=1)
    if group_ids.shape != labels.shape:
        raise ValueError(f"group_ids must give one microbatch per example (got {tuple(group_ids.shape)} "
                         f"for {labels.shape[0]} examples)")
    device = device_of(model)
    trainable, params, fixed = functional_parameters(model, flat_weights, device)
    total = torch.zeros(sum(parameter.numel() for _, parameter in trainable), dtype=torch.float32, device=device)
    inputs, labels, group_ids = inputs.to(device), labels.to(device), group_ids.to(device)

    def mean_loss(trainable_params, members, member_labels):
        return loss_fn(functional_call(model, (trainable_params, fixed), (members,)), member_labels)

    def gradient_of(members: torch.Tensor) -> torch.Tensor:
        gradients = grad(mean_loss)(params, inputs[members], labels[members])
        return torch.cat([gradients[name].reshape(-1).to(torch.float32) for name, _ in trainable])

    norms, zeroed = [], 0
    for group in torch.unique(group_ids):
        members = torch.nonzero(group_ids == group).flatten()
        flat = gradient_of(members)
        if not flat.isfinite().all():
            # One member's NaN or inf makes the whole mean non-finite: the
            # microbatch is taken again without the members whose own gradient is.
            kept = members[torch.tensor([bool(gradient_of(member.reshape(1)).isfinite().all()) for member in members],
                                        dtype=torch.bool, device=members.device)]
            flat = gradient_of(kept) if kept.numel() else flat.new_zeros(flat.shape)
            if not flat.isfinite().all():
                flat, kept = flat.new_zeros(flat.shape), kept[:0]
            zeroed += members.numel() - kept.numel()
            if not kept.numel():
                continue
        norms.append(flat.norm())
        total += flat * clip_factors(norms[-1], clip_norm)
    if return_norms:
        return total, torch.stack(norms) if norms else total.new_zeros(0), zeroed
    return total


def check_views(inputs: torch.Tensor, augmentations: int) -> None:
    """Raise ValueError unless ``augmentations`` is an integer >= 1 and, above 1, ``inputs`` are [n, K, ...]."""
    if isinstance(augmentations, bool) or not isinstance(augmentations, int) or augmentations < 1:
        raise ValueError(f"augmentations must be an integer >= 1 (got {augmentations!r}); it is K, the views "
                         "whose mean gradient is clipped per example")
    if augmentations > 1 and (inputs.dim() < 2 or inputs.shape[1] != augmentations):
        raise ValueError(f"with {augmentations} augmentations per example, inputs must be [n, {augmentations}, ...] "
                         f"(got shape {tuple(inputs.shape)}); stack each example's views along dimension 1")


def per_example_gradients(
    model: nn.Module, params: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor], loss_fn: LossFunction,
    augmentations: int, device: torch.device,
) -> Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
    """A function of (inputs, labels) giving each example's gradient per trainable parameter, as [n, ...] tensors.

    The parameters are `params` (trainable) and `fixed`; an example's loss
    is as in `per_example_clipped_sum`. The gradients come from one vmapped
    grad, or, for a loss torch.func cannot batch, through the outputs'
    gradients taken outside vmap (a class loss has no such fallback: its
    error is raised).
    """

    def example_outputs(trainable_params, example):
        # One example's outputs [1, ...], or with K views [K, ...]: the K views run as one batch.
        views = example.unsqueeze(0) if augmentations == 1 else example
        return functional_call(model, (trainable_params, fixed), (views,))

    def example_loss(trainable_params, example, label):
        # Each view's loss is the loss of a batch of one, as for a single example.
        outputs = example_outputs(trainable_params, example)
        return per_example_losses(loss_fn, outputs, label.expand(outputs.shape[0], *label.shape)).mean()

    def output_dot(trainable_params, example, output_gradient):
        return (example_outputs(trainable_params, example) * output_gradient).sum()

    # randomness="different" gives each example its own dropout mask, as a
    # plain per-example loop would.
    per_example_grads = vmap(grad(example_loss), in_dims=(None, 0, 0), randomness="different")

    def through_output_gradients(chunk: torch.Tensor, chunk_labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-example gradients for a loss torch.func cannot batch: its output gradients are taken outside vmap.

        Each example's outputs come from one vmapped forward; the loss's
        gradient at them from autograd over ``per_example_losses`` (which then
        runs one example at a time); the parameters' gradients from a second
        vmapped pass that draws the same random numbers as the first.
        """
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            outputs = vmap(example_outputs, in_dims=(None, 0), randomness="different")(params, chunk)
        views = outputs.shape[1]
        leaf = outputs.detach().requires_grad_()
        with torch.enable_grad():
            losses = per_example_losses(loss_fn, leaf.flatten(0, 1), chunk_labels.repeat_interleave(views, 0))
            (output_gradients,) = torch.autograd.grad(losses.reshape(-1, views).mean(1).sum(), leaf)
        return vmap(grad(output_dot), in_dims=(None, 0, 0), randomness="different")(params, chunk, output_gradients)

    def gradients(chunk: torch.Tensor, chunk_labels: torch.Tensor) -> dict[str, torch.Tensor]:
        try:
            return per_example_grads(params, chunk, chunk_labels)
        except RuntimeError:
            if class_loss_of(loss_fn) is not None:
                raise
            return through_output_gradients(chunk, chunk_labels)

    return gradients


@keeps_buffers
@in_ieee_float32
def per_example_clipped_sum(
    model: nn.Module,
    flat_weights: torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    clip_norm: ClipNorm,
    max_physical_batch: int,
    loss_fn: LossFunction = F.cross_entropy,
    return_norms: bool = False,
    augmentations: int = 1,
    precision: str = "fp32",
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over examples of each example's gradient clipped to L2 norm ``clip_norm``: the vmap engine.

    The gradient of example i is that of ``loss_fn(model(x_i[None]), y_i[None])``
    (``workers.losses.per_example_losses``: an example with nothing to average
    over has loss 0) at the parameters ``flat_weights`` (laid out as by
    ``workers.models.flat_parameters``); the model's own parameters and their
    ``.grad`` are neither used nor touched, only its buffers and structure.
    Examples are processed ``max_physical_batch`` at a time to bound memory.

    With ``augmentations`` K > 1 (augmentation multiplicity), ``inputs`` are
    [n, K, ...]: K views of each example. Example i's gradient is then the
    mean over its views of ``loss_fn(model(v[None]), y_i[None])``'s gradient,
    and that mean is what is clipped: all K views come from one example, so
    the example still moves the sum by at most ``clip_norm``.

    Returns a 1-D float32 tensor of length ``parameter_count(model)`` on the
    model's device; zeros when there are no examples. An example whose
    gradient holds a NaN or inf contributes exactly zero; its norm is returned
    as it came out, not finite, which is how callers count such examples.
    With ``return_norms`` it
    also returns, per trainable parameter name, the [n] per-example L2 norms of
    that parameter's gradient before clipping (an example's total norm is the
    root of the sum of their squares).

    With ``precision`` "bf16" the forward and backward passes run under
    bfloat16 autocast (``workers.clipping.autocast_for``); each per-example
    gradient is cast to float32 before its norm, its clip factor and the sum,
    so every clipped contribution still has norm <= ``clip_norm``.
    """
    check_arguments(model, flat_weights, inputs, labels, clip_norm, max_physical_batch)
    device = device_of(model)
    autocast = autocast_for(precision, device)
    trainable, params, fixed = functional_parameters(model, flat_weights, device)
    if not trainable:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return (empty, {}) if return_norms else empty

    check_views(inputs, augmentations)
    gradients = per_example_gradients(model, params, fixed, loss_fn, augmentations, device)
    sums = {name: torch.zeros(parameter.shape, dtype=torch.float32, device=device) for name, parameter in trainable}
    norms: dict[str, list[torch.Tensor]] = {name: [] for name, _ in trainable}
    inputs = inputs.to(device)
    labels = labels.to(device)
    for start in range(0, inputs.shape[0], max_physical_batch):
        # torch.func can batch recurrent layers unrolled step by step, not their fused kernels.
        chunk, chunk_labels = inputs[start : start + max_physical_batch], labels[start : start + max_physical_batch]
        with unrolled_recurrences(model), autocast:
            grads = gradients(chunk, chunk_labels)
        squared = {name: g.to(torch.float32).flatten(1).pow(2).sum(dim=1) for name, g in grads.items()}
        finite = torch.stack(list(squared.values())).sum(0).isfinite()
        factors = clip_factors_by_parameter(squared, clip_norm)
        for name, g in grads.items():
            sums[name] += torch.tensordot(factors[name], without_non_finite(g.to(torch.float32), finite), dims=1)
            norms[name].append(squared[name].sqrt())
    flat = torch.cat([sums[name].reshape(-1) for name, _ in trainable])
    if not return_norms:
        return flat
    return flat, {name: torch.cat(values) if values else flat.new_zeros(0) for name, values in norms.items()}
