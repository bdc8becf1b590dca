"""Refuse models whose layers break per-example privacy, and rewrite the common case.

DP-SGD bounds each example's influence by clipping its own gradient. A layer
that mixes examples within a batch (batch normalisation) makes one example's
gradient depend on the others, so the bound no longer holds. GroupNorm
normalises within each example and is the usual replacement.

Only parameters learn, and only from clipped, noised sums. A buffer that a
training forward writes (running statistics, a counter, a cache) would learn
from private batches with neither clipping nor noise, and carry that into
evaluation and the saved model. So buffers are constants: modules known to
keep running statistics are refused up front (``check_model``), and every
forward on private examples runs under ``unchanged_buffers``, which puts any
written buffer back as it was and refuses the model, naming the buffer. One
rule for all modules, because a frozen copy of statistics meant to be learned
would make evaluation silently differ from training.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

from workers.clipping import device_of

# Every batch-norm flavour (BatchNorm1d/2d/3d, LazyBatchNorm*, SyncBatchNorm)
# derives from _BatchNorm, so one isinstance check covers present and future ones.
EXAMPLE_MIXING_TYPES: tuple[type[nn.Module], ...] = (_BatchNorm,)

_MAX_GROUPS = 32


class UnsupportedModuleError(ValueError):
    """A model contains modules that mix examples within a batch; the message lists them all."""


def unsupported_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every module that mixes examples; the root is named ''."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, EXAMPLE_MIXING_TYPES)]


def running_statistics_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every module that updates running statistics in training (InstanceNorm*).

    Batch norms are left to ``unsupported_modules``, which refuses them whatever their settings.
    """
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, _NormBase) and module.track_running_stats and not isinstance(module, _BatchNorm)]


def _listing(modules: list[tuple[str, nn.Module]]) -> str:
    return ", ".join(f"{name or '(root)'} ({type(module).__name__})" for name, module in modules)


def check_model(model: nn.Module) -> None:
    """Raise ``UnsupportedModuleError`` naming every example-mixing or statistics-learning module and the fix."""
    mixing, learning = unsupported_modules(model), running_statistics_modules(model)
    problems = []
    if mixing:
        problems.append(
            f"{len(mixing)} module(s) that mix examples within a batch, which breaks per-example gradient "
            f"clipping: {_listing(mixing)}. Replace each with GroupNorm, e.g. nn.GroupNorm(min(32, C), C) for "
            "C channels, or call workers.validation.replace_batchnorm(model) to do it for you."
        )
    if learning:
        problems.append(
            f"{len(learning)} module(s) that learn running statistics from each training batch, unclipped and "
            f"un-noised, and use them in evaluation and the saved model: {_listing(learning)}. Build each with "
            "track_running_stats=False, which normalises by each example's own statistics in training and "
            "evaluation alike."
        )
    if problems:
        raise UnsupportedModuleError("model has " + " It also has ".join(problems))


@contextlib.contextmanager
def unchanged_buffers(model: nn.Module, probe: Callable[[], object] | None = None) -> Iterator[None]:
    """Run the block, then put back every buffer of ``model`` that it wrote or replaced, and refuse the model.

    A buffer counts as written when its version counter moved, its values
    changed (a write through ``.data``) or the module holds another tensor
    under its name. Whatever happens in the block, every buffer leaves it as
    it entered. If one was written, ``UnsupportedModuleError`` names each such
    buffer and its module. When the block raises without having written a
    buffer (torch.func refuses in-place writes before they happen), ``probe``
    (a plain training forward on the same examples) is run, under the same
    watch, to tell whether a buffer write was the cause.
    """
    before = {name: (buffer, buffer._version, buffer.clone()) for name, buffer in model.named_buffers()}
    try:
        yield
    except Exception as error:
        written = _put_back(model, before)
        if isinstance(error, UnsupportedModuleError):
            raise
        if not written and probe is not None:
            written = _probed_writes(model, before, probe)
        if written:
            raise UnsupportedModuleError(_buffer_message(model, written)) from error
        raise
    written = _put_back(model, before)
    if written:
        raise UnsupportedModuleError(_buffer_message(model, written))


def _probed_writes(model: nn.Module, before: dict, probe: Callable[[], object]) -> list[str]:
    try:
        with torch.no_grad():
            probe()
    except Exception:
        # The probe runs only to name a cause; any failure of its own leaves the original error standing.
        pass
    return _put_back(model, before)


def _put_back(model: nn.Module, before: dict[str, tuple[torch.Tensor, int, torch.Tensor]]) -> list[str]:
    """Restore every buffer that differs from ``before`` (tensor, version, values); return their names."""
    written = []
    now = dict(model.named_buffers())
    for name, (buffer, version, values) in before.items():
        current = now.get(name)
        if current is buffer and buffer._version == version and _same(buffer, values):
            continue
        written.append(name)
        with torch.no_grad():
            buffer.copy_(values)
        if current is not buffer:
            owner, _, attribute = name.rpartition(".")
            model.get_submodule(owner).register_buffer(attribute, buffer)
    return written


def _same(tensor: torch.Tensor, values: torch.Tensor) -> bool:
    if tensor.shape != values.shape or tensor.dtype != values.dtype:
        return False
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(((tensor == values) | (tensor.isnan() & values.isnan())).all())
    return torch.equal(tensor, values)


def _buffer_message(model: nn.Module, written: list[str]) -> str:
    owners = [name.rpartition(".")[0] for name in written]
    listing = ", ".join(f"{name} (in {owner or '(root)'}, {type(model.get_submodule(owner)).__name__})"
                        for name, owner in zip(written, owners, strict=True))
    return (
        f"the model's forward writes buffer(s) {listing}: a buffer would learn from private batches "
        "without clipping or noise and carry that into evaluation and the saved model. Keep what the module "
        "learns in parameters (nn.Parameter), compute statistics per example without storing them, or for "
        "normalisation layers set track_running_stats=False. The buffers were put back as they were."
    )


def keeps_buffers(engine: Callable) -> Callable:
    """Decorate a clipping function taking ``model`` and ``inputs`` so that it runs under ``unchanged_buffers``.

    The probe, run only if the function fails, is the model's plain forward on the first example.
    """
    signature = inspect.signature(engine)

    @functools.wraps(engine)
    def wrapper(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        model, inputs = arguments["model"], arguments["inputs"]
        with unchanged_buffers(model, lambda: model(inputs[:1].to(device_of(model)))):
            return engine(*args, **kwargs)

    return wrapper


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
