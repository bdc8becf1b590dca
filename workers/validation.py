"""Refuse models whose layers break per-example privacy, and rewrite the common case.

DP-SGD bounds each example's influence by clipping its own gradient. A layer
that mixes examples within a batch (batch normalisation) makes one example's
gradient depend on the others, so the bound no longer holds. GroupNorm
normalises within each example and is the usual replacement.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

# Every batch-norm flavour (BatchNorm1d/2d/3d, LazyBatchNorm*, SyncBatchNorm)
# derives from _BatchNorm, so one isinstance check covers present and future ones.
EXAMPLE_MIXING_TYPES: tuple[type[nn.Module], ...] = (_BatchNorm,)

_MAX_GROUPS = 32


class UnsupportedModuleError(ValueError):
    """A model contains modules that mix examples within a batch; the message lists them all."""


def unsupported_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every module that mixes examples; the root is named ''."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, EXAMPLE_MIXING_TYPES)]


def check_model(model: nn.Module) -> None:
    """Raise ``UnsupportedModuleError`` naming every example-mixing module and the fix."""
    offenders = unsupported_modules(model)
    if not offenders:
        return
    listing = ", ".join(f"{name or '(root)'} ({type(module).__name__})" for name, module in offenders)
    raise UnsupportedModuleError(
        f"model has {len(offenders)} module(s) that mix examples within a batch, which breaks "
        f"per-example gradient clipping: {listing}. Replace each with GroupNorm, "
        "e.g. nn.GroupNorm(min(32, C), C) for C channels, or call "
        "workers.validation.replace_batchnorm(model) to do it for you."
    )


def group_count(num_channels: int) -> int:
    """Groups for the GroupNorm replacing a C-channel batch norm: the largest divisor of C up to 32.

    This is Opacus' min(32, C) whenever that divides C, and still valid when it does not.
    """
    if num_channels < 1:
        raise ValueError(f"num_channels must be >= 1 (got {num_channels})")
    return max(groups for groups in range(1, min(_MAX_GROUPS, num_channels) + 1) if num_channels % groups == 0)


def replace_batchnorm(model: nn.Module) -> nn.Module:
    """Swap every batch norm in ``model`` for a GroupNorm over the same channels, in place.

    Returns the model (a new GroupNorm if the model itself was a batch norm).
    Affine-ness and eps are kept; learned statistics are dropped, so fine-tune
    after rewriting a trained model.
    """
    for name, module in unsupported_modules(model):
        replacement = _group_norm_for(name, module)
        if not name:
            return replacement
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, replacement)
    return model


def _group_norm_for(name: str, batch_norm: _BatchNorm) -> nn.GroupNorm:
    if batch_norm.num_features < 1:
        raise UnsupportedModuleError(
            f"{name or '(root)'} ({type(batch_norm).__name__}) does not know its channel count yet; "
            "run one forward pass to initialise it before replace_batchnorm, or replace it by hand "
            "with nn.GroupNorm(min(32, C), C)"
        )
    channels = batch_norm.num_features
    group_norm = nn.GroupNorm(group_count(channels), channels, eps=batch_norm.eps, affine=batch_norm.affine)
    if batch_norm.affine:
        group_norm.to(device=batch_norm.weight.device, dtype=batch_norm.weight.dtype)
    return group_norm
