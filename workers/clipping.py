"""Per-example gradient clipping and summation: the pure core of a worker's step.

Each example's gradient (all trainable parameters flattened together, in
``named_parameters()`` order) is scaled to L2 norm at most ``clip_norm`` and
the clipped gradients are summed. The driver adds noise to the sum over all
workers, so the sensitivity of that sum to one example is ``clip_norm``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from workers.models import parameter_count
from workers.recurrent import unrolled_recurrences

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The GPU settings that may swap float32 arithmetic for TF32 (10-bit mantissa).
FLOAT32_PRECISION_SETTINGS = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Run float32 matrix products and convolutions in IEEE float32 (no TF32), then restore the settings.

    cuDNN convolutions use TF32 by default on Ampere and later GPUs, where
    per-example norms came out up to 1.5e-2 relative off (ResNet-18-GN on an
    H100). The clip factor comes from the norm and the clipped sum from other
    kernels, so an example scaled to "norm C" could contribute more than C,
    beyond the sensitivity the noise is calibrated to. In IEEE float32 the
    bound holds to float32 rounding, as on the CPU (where these settings
    change nothing).
    """
    previous = [setting.fp32_precision for setting in FLOAT32_PRECISION_SETTINGS]
    try:
        for setting in FLOAT32_PRECISION_SETTINGS:
            setting.fp32_precision = "ieee"
        yield
    finally:
        for setting, value in zip(FLOAT32_PRECISION_SETTINGS, previous, strict=True):
            setting.fp32_precision = value


def in_ieee_float32(function: Callable) -> Callable:
    """Decorate a clipping function so that it always runs under ``ieee_float32``."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with ieee_float32():
            return function(*args, **kwargs)

    return wrapper


def clip_factors(per_example_norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Scale factors min(1, clip_norm / ||g_i||) for per-example gradient norms; 1 for a zero gradient.

    A norm that is not finite (a NaN or inf in the gradient) gets factor 0:
    ``NaN > clip_norm`` is false, so it would otherwise pass unscaled. The
    caller must still keep that example's gradient out of the sum, since
    0 * NaN is NaN (``without_non_finite``).
    """
    # The division is evaluated for every entry, but torch.where takes 1 for
    # norms at or below clip_norm, so a zero norm never yields inf or nan.
    factors = torch.where(per_example_norms > clip_norm, clip_norm / per_example_norms, 1.0)
    return torch.where(per_example_norms.isfinite(), factors, 0.0)


def without_non_finite(per_example: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """Per-example tensors [n, ...] with the rows of examples that are not ``finite`` [n] set to exactly 0."""
    return torch.where(finite.reshape(-1, *([1] * (per_example.dim() - 1))), per_example, 0.0)


@dataclass(frozen=True)
class LayerClipNorms:
    """Per-layer clipping: each parameter group, named by a parameter-name prefix, has its own L2 bound.

    A parameter belongs to the longest prefix that equals its name or its name
    up to a dot. One example then moves the sum by at most
    sqrt(sum of squared group norms): the total sensitivity.
    """

    groups: tuple[tuple[str, float], ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("per-layer clipping needs at least one (parameter prefix, clip norm) group")
        for prefix, norm in self.groups:
            if not (isinstance(norm, (int, float)) and norm > 0 and math.isfinite(norm)):
                raise ValueError(f"the clip norm of group {prefix!r} must be a finite number > 0 (got {norm!r})")

    @property
    def total_norm(self) -> float:
        """The total sensitivity: the root of the sum of the squared group norms."""
        return math.sqrt(sum(norm**2 for _, norm in self.groups))

    def group_of(self, parameter_name: str) -> int | None:
        """Index of the group that owns a parameter, or None."""
        matches = [
            (len(prefix), index) for index, (prefix, _) in enumerate(self.groups)
            if parameter_name == prefix or parameter_name.startswith(prefix + ".")
        ]
        return max(matches)[1] if matches else None

    def unmatched(self, parameter_names: list[str]) -> list[str]:
        """The parameters no group owns."""
        return [name for name in parameter_names if self.group_of(name) is None]


ClipNorm = Union[float, LayerClipNorms]


def clip_factors_by_parameter(squared_norms: dict[str, torch.Tensor], clip_norm: ClipNorm) -> dict[str, torch.Tensor]:
    """Per parameter, the [n] factors that clip each example: over the whole gradient, or within its group."""
    if not isinstance(clip_norm, LayerClipNorms):
        factors = clip_factors(torch.stack(list(squared_norms.values())).sum(0).sqrt(), clip_norm)
        return {name: factors for name in squared_norms}
    owners = {name: clip_norm.group_of(name) for name in squared_norms}
    factors_of_group = {}
    for group in set(owners.values()):
        members = [squared_norms[name] for name, owner in owners.items() if owner == group]
        factors_of_group[group] = clip_factors(torch.stack(members).sum(0).sqrt(), clip_norm.groups[group][1])
    return {name: factors_of_group[owner] for name, owner in owners.items()}


def functional_parameters(
    model: nn.Module, flat_weights: torch.Tensor, device: torch.device
) -> tuple[list[tuple[str, nn.Parameter]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trainable (name, parameter) pairs, their values taken from ``flat_weights``, frozen parameters and buffers).

    The values are what torch.func.functional_call takes; frozen parameters and
    buffers stay as the model holds them.
    """
    trainable = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    weights = flat_weights.detach().to(device=device, dtype=torch.float32)
    params = {
        name: chunk.reshape(parameter.shape).to(parameter.dtype)
        for (name, parameter), chunk in zip(trainable, torch.split(weights, [p.numel() for _, p in trainable]),
                                            strict=True)
    }
    fixed = {name: parameter for name, parameter in model.named_parameters() if not parameter.requires_grad}
    fixed.update(dict(model.named_buffers()))
    return trainable, params, fixed


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
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over examples of each example's gradient clipped to L2 norm ``clip_norm``: the vmap engine.

    The gradient of example i is that of ``loss_fn(model(x_i[None]), y_i[None])``
    at the parameters ``flat_weights`` (laid out as by
    ``workers.models.flat_parameters``); the model's own parameters and their
    ``.grad`` are neither used nor touched, only its buffers and structure.
    Examples are processed ``max_physical_batch`` at a time to bound memory.

    Returns a 1-D float32 tensor of length ``parameter_count(model)`` on the
    model's device; zeros when there are no examples. An example whose
    gradient holds a NaN or inf contributes exactly zero; its norm is returned
    as it came out, not finite, which is how callers count such examples.
    With ``return_norms`` it
    also returns, per trainable parameter name, the [n] per-example L2 norms of
    that parameter's gradient before clipping (an example's total norm is the
    root of the sum of their squares).
    """
    check_arguments(model, flat_weights, inputs, labels, clip_norm, max_physical_batch)
    device = device_of(model)
    trainable, params, fixed = functional_parameters(model, flat_weights, device)
    if not trainable:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return (empty, {}) if return_norms else empty

    def example_loss(trainable_params, example, label):
        logits = functional_call(model, (trainable_params, fixed), (example.unsqueeze(0),))
        return loss_fn(logits, label.unsqueeze(0))

    # randomness="different" gives each example its own dropout mask, as a
    # plain per-example loop would.
    per_example_grads = vmap(grad(example_loss), in_dims=(None, 0, 0), randomness="different")

    sums = {name: torch.zeros(parameter.shape, dtype=torch.float32, device=device) for name, parameter in trainable}
    norms: dict[str, list[torch.Tensor]] = {name: [] for name, _ in trainable}
    inputs = inputs.to(device)
    labels = labels.to(device)
    for start in range(0, inputs.shape[0], max_physical_batch):
        # torch.func can batch recurrent layers unrolled step by step, not their fused kernels.
        with unrolled_recurrences(model):
            grads = per_example_grads(
                params, inputs[start : start + max_physical_batch], labels[start : start + max_physical_batch]
            )
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


ENGINES: tuple[str, ...] = ("fast", "vmap")
"""Clipping engines by name: "fast" (book-keeping, ``workers.engines``) and "vmap" (torch.func, above)."""


def check_engine(engine: str) -> None:
    """Raise ValueError unless ``engine`` names one of ``ENGINES``."""
    if engine not in ENGINES:
        raise ValueError(
            f"engine must be one of {', '.join(repr(name) for name in ENGINES)} (got {engine!r}); "
            "'fast' is the default, 'vmap' the slower reference engine"
        )


def clipped_sum(
    engine: str,
    model: nn.Module,
    flat_weights: torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    clip_norm: ClipNorm,
    max_physical_batch: int,
    loss_fn: LossFunction = F.cross_entropy,
    return_norms: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``per_example_clipped_sum`` computed by the named engine (see ``ENGINES``); same arguments and result."""
    check_engine(engine)
    if engine == "vmap":
        return per_example_clipped_sum(
            model, flat_weights, inputs, labels, clip_norm, max_physical_batch, loss_fn, return_norms
        )
    # Imported here because workers.engines builds on this module.
    from workers.engines import fast_clipped_sum

    return fast_clipped_sum(model, flat_weights, inputs, labels, clip_norm, max_physical_batch, loss_fn, return_norms)


def check_arguments(
    model: nn.Module,
    flat_weights: torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    clip_norm: ClipNorm,
    max_physical_batch: int,
) -> None:
    """Raise ValueError, saying what is wrong and what is valid, for arguments no engine can use."""
    if isinstance(clip_norm, LayerClipNorms):
        unmatched = clip_norm.unmatched([name for name, p in model.named_parameters() if p.requires_grad])
        if unmatched:
            raise ValueError(
                f"per-layer clipping leaves parameters without a group: {', '.join(unmatched)}; "
                "give every trainable parameter a prefix in layer_clip_norms"
            )
    elif not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError(f"clip_norm must be a finite number > 0 (got {clip_norm}); it is the per-example L2 bound")
    if (
        isinstance(max_physical_batch, bool)
        or not isinstance(max_physical_batch, numbers.Integral)
        or max_physical_batch < 1
    ):
        raise ValueError(
            f"max_physical_batch must be an integer >= 1 (got {max_physical_batch!r}); "
            "it caps how many examples' gradients are held in memory at once"
        )
    expected = parameter_count(model)
    if flat_weights.dim() != 1 or flat_weights.numel() != expected:
        raise ValueError(
            f"flat_weights must be 1-D with {expected} entries for this model (got shape "
            f"{tuple(flat_weights.shape)}); build it with workers.models.flat_parameters"
        )
    if inputs.shape[0] != labels.shape[0]:
        raise ValueError(
            f"inputs and labels must hold the same number of examples (got {inputs.shape[0]} and {labels.shape[0]})"
        )


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter; the CPU for a model without parameters."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")
