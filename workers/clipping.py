"""The clip arithmetic and the types both clipping engines share.

Each example's gradient (all trainable parameters flattened together, in
``named_parameters()`` order) is scaled to L2 norm at most ``clip_norm`` and
the clipped gradients are summed. The driver adds noise to the sum over all
workers, so the sensitivity of that sum to one example is ``clip_norm``.

The engines that compute the sums build on this module and nothing here
imports them: ``workers.vmap_engine`` (torch.func) and ``workers.engines``
(the fast engine, and the registry of engines by name).
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
from torch import nn

from workers.models import parameter_count
from workers.names import PRECISIONS

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


def check_precision(precision: str) -> None:
    """Raise ValueError unless ``precision`` is one of ``workers.names.PRECISIONS``: "fp32" or "bf16" (the forward
    and backward passes in bfloat16; the norms, the clipping and the sums are float32 in both)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))} (got {precision!r})")


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward and backward passes' context: bfloat16 autocast on ``device`` for "bf16", nothing for "fp32".

    Only the per-example gradients are computed under it; the caller casts
    each to float32 before its norm is taken, so the clip factor and the
    clipped gradient come from the same float32 tensor and the clipped
    contribution has norm <= C to float32 rounding, as in "fp32".
    """
    check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


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
