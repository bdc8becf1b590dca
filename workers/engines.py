"""The fast clipping engine: per-example gradient norms by book-keeping, clipped sums in one weighted pass.

Same contract as ``workers.clipping.per_example_clipped_sum`` (the vmap engine),
computed differently. For each chunk of at most ``max_physical_batch`` examples:

1. One forward pass over the whole chunk records, for every layer with
   trainable parameters, its input, and (by a hook on its output) the gradient
   of the summed per-example losses at its output. The parameters are plain
   tensors that do not require grad, so the one backward pass computes output
   gradients only: no weight gradients, and no input gradient for a first layer.
2. The rule registered for the layer's type turns (input, output gradient)
   into the per-example squared norm of each of its parameters' gradients,
   either as a ghost norm (from two Gram matrices, never forming the
   per-example gradients) or by instantiating the per-example gradients,
   whichever costs less for the layer's shape (``instantiation_is_cheaper``).
3. Per-parameter norms add up to each example's total norm and clip factor;
   each parameter's clipped sum is then the weight-gradient half of a backward
   pass in which example i's loss is weighted by its clip factor, formed from
   what step 2 kept (a weighted contraction, or a weighted sum of the
   instantiated per-example gradients).

Layer types without a rule, and modules holding parameters of their own that
are not a registered layer type (``nn.MultiheadAttention``, custom modules),
fall back to ``torch.func.vmap`` over that one module's per-example gradients.
Models the per-layer view cannot serve (tied parameters, a fallback module
that draws random numbers, a recorded input changed in place afterwards) run
on the vmap engine whole, with a warning saying why.

Assumption shared with Opacus: every module with trainable parameters sees the
examples along dimension 0 of its tensor inputs and outputs (for
``nn.MultiheadAttention``, the dimension its ``batch_first`` says).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from workers import clipping


@dataclass(frozen=True)
class ParameterGradients:
    """What the engine needs of one parameter's per-example gradients g_i over a chunk of B examples.

    ``squared_norms`` is [B]: ||g_i||^2. ``clipped_sum(factors)`` returns
    sum_i factors[i] * g_i, shaped like the parameter. ``path`` says how they
    were obtained: "ghost" (never formed per example) or "per-example".
    """

    squared_norms: Tensor
    clipped_sum: Callable[[Tensor], Tensor]
    path: str = "per-example"


@dataclass
class OutputSlot:
    """One tensor output of a recorded layer call and, after the backward pass, the loss gradient at it."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    grad: Tensor | None = None

    def keep(self, gradient: Tensor) -> None:
        """Tensor-hook callback: remember the gradient, change nothing."""
        self.grad = gradient

    def gradient(self) -> Tensor:
        """The recorded gradient; zeros when the loss did not depend on this output."""
        if self.grad is None:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.grad


@dataclass
class LayerCall:
    """One call of a layer in the recorded forward pass: its arguments and, per tensor output, a slot.

    ``outputs`` follows the flattened output (``torch.utils._pytree``); it
    holds None for outputs that are not floating-point tensors.
    """

    args: tuple
    kwargs: dict
    outputs: list[OutputSlot | None]
    versions: tuple[int, ...]

    @property
    def input(self) -> Tensor:
        """The first positional argument: the input of a single-input layer."""
        return self.args[0]

    @property
    def output_grad(self) -> Tensor:
        """The loss gradient at the first output: that of a single-output layer."""
        return self.outputs[0].gradient()


LayerRule = Callable[[nn.Module, Mapping[str, Tensor], list[LayerCall], int], dict[str, ParameterGradients]]
"""(layer, its trainable parameters by local name, its calls, batch size) -> per-parameter gradients."""


@dataclass(frozen=True)
class _Registered:
    rule: LayerRule
    supports: Callable[[nn.Module], bool]


_RULES: dict[type[nn.Module], _Registered] = {}


def register_rule(
    layer_type: type[nn.Module], supports: Callable[[nn.Module], bool] = lambda layer: True
) -> Callable[[LayerRule], LayerRule]:
    """Register a rule for exactly ``layer_type`` (subclasses may override forward, so they are not covered).

    ``supports`` can decline a layer whose configuration the rule does not
    handle; that layer then takes the vmap fallback.
    """

    def add(rule: LayerRule) -> LayerRule:
        _RULES[layer_type] = _Registered(rule, supports)
        return rule

    return add


def rule_for(layer: nn.Module) -> LayerRule | None:
    """The registered rule for this layer, or None when it takes the vmap fallback."""
    registered = _RULES.get(type(layer))
    if registered is None or not registered.supports(layer):
        return None
    return registered.rule


class WholeModelFallback(Exception):
    """Raised inside the engine when the per-layer view cannot serve this model; carries the reason."""


# ---------------------------------------------------------------------------
# Shared math


def instantiation_is_cheaper(positions: int, in_features: int, out_features: int) -> bool:
    """Whether to form a layer's per-example weight gradients rather than take their ghost norm.

    Per example and per group, a weight gradient is g a with g [p, T] (output
    gradients at T positions) and a [T, d] (the inputs there). Both paths pay
    T d p once for the product that yields the clipped sum (the ghost path in
    one [p, B T] x [B T, d] product, instantiation in forming g a), so they differ by
    T^2 (d + p) for the two Gram matrices of the ghost norm against 2 p d to
    take the norm of and weight the instantiated [p, d]. Instantiation also
    holds p d numbers per example until the clip factors are known, so it is
    taken only while that stays within twice the layer's windows (T d), i.e.
    p <= 2 T: that keeps the wide, late layers of deep networks on ghost norms.
    """
    return (
        out_features <= 2 * positions
        and 2 * in_features * out_features < positions * positions * (in_features + out_features)
    )


def _squared_norms(per_example: Tensor) -> Tensor:
    return torch.linalg.vector_norm(per_example.flatten(1), dim=1).square()


def instantiated(per_example: Tensor, layout: Callable[[Tensor], Tensor] = lambda summed: summed) -> ParameterGradients:
    """ParameterGradients from per-example gradients [B, ...] held in memory.

    ``layout`` maps a weighted sum over examples [...] to the parameter's shape.
    """
    return ParameterGradients(
        _squared_norms(per_example),
        lambda factors: layout(torch.tensordot(factors.to(per_example.dtype), per_example, 1)),
    )


def outer_product_gradients(
    output_grads: Tensor, activations: Tensor, layout: Callable[[Tensor], Tensor]
) -> ParameterGradients:
    """Per-example gradients g_i a_i of a weight used in a matrix product, per group.

    ``output_grads`` [B, G, p, T] and ``activations`` [B, G, T, d] (T
    positions, G groups); ``layout`` maps a [G, p, d] sum to the weight's
    shape. Without instantiation, the clipped sum is one matrix product per
    group over all examples and positions, [p, B*T] x [B*T, d].
    """
    batch, groups, positions, in_features = activations.shape
    out_features = output_grads.shape[2]
    if instantiation_is_cheaper(positions, in_features, out_features):
        return instantiated(torch.matmul(output_grads, activations), layout)

    def clipped_sum(factors: Tensor) -> Tensor:
        weighted = _scaled(output_grads, factors).permute(1, 2, 0, 3).reshape(groups, out_features, -1)
        return layout(torch.bmm(weighted, activations.transpose(0, 1).reshape(groups, -1, in_features)))

    return ParameterGradients(ghost_squared_norms(output_grads, activations), clipped_sum, "ghost")


def ghost_squared_norms(output_grads: Tensor, activations: Tensor) -> Tensor:
    """Per-example squared norms [B] of the gradients g_i a_i (summed over groups), never forming them.

    ``output_grads`` [B, G, p, T], ``activations`` [B, G, T, d]: the norm is
    the inner product of the two [T, T] Gram matrices, a_i a_i^T and g_i^T g_i.
    """
    if activations.shape[2] == 1:
        # g a is an outer product; its norm is ||a|| ||g||.
        squared = torch.linalg.vector_norm(activations, dim=(2, 3)).square()
        return (squared * torch.linalg.vector_norm(output_grads, dim=(2, 3)).square()).sum(1)
    activation_gram = torch.matmul(activations, activations.transpose(2, 3))
    gradient_gram = torch.matmul(output_grads.transpose(2, 3), output_grads)
    return torch.linalg.vecdot(activation_gram.flatten(1), gradient_gram.flatten(1))


def _scaled(tensor: Tensor, factors: Tensor) -> Tensor:
    return tensor * factors.to(tensor.dtype).reshape(-1, *([1] * (tensor.dim() - 1)))


# ---------------------------------------------------------------------------
# Rules, one per layer type


@register_rule(nn.Linear)
def linear_rule(
    layer: nn.Linear, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """Linear on [B, d] or [B, *, d] inputs: ghost norm or instantiation for the weight, sums for the bias."""
    inputs = _joined([call.input.reshape(batch_size, -1, layer.in_features) for call in calls], 1)
    output_grads = _joined([call.output_grad.reshape(batch_size, -1, layer.out_features) for call in calls], 1)
    result = {}
    if "weight" in params:
        result["weight"] = outer_product_gradients(
            output_grads.transpose(1, 2).unsqueeze(1), inputs.unsqueeze(1),
            lambda summed: summed.view(layer.out_features, layer.in_features),
        )
    if "bias" in params:
        result["bias"] = instantiated(output_grads.sum(1))
    return result


def _conv_input(layer: nn.Conv2d, inputs: Tensor) -> tuple[Tensor, tuple[int, int]]:
    """The input as the convolution sees it, with the padding still to apply (zero padding stays implicit)."""
    if layer.padding_mode == "zeros" and not isinstance(layer.padding, str):
        return inputs, layer.padding
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    return F.pad(inputs, layer._reversed_padding_repeated_twice, mode=mode), (0, 0)


def patches(layer: nn.Conv2d, inputs: Tensor, padding: tuple[int, int]) -> Tensor:
    """The input windows each output position sees, [B, G, L, d] for G groups and L positions.

    One strided copy, for Gram matrices, which do not depend on the order of
    a window's d entries: (kh, kw, channel) from a channels-last copy, whose
    contiguous channel runs make the copy fast, unless a group has a single
    channel, where (channel, kh, kw) keeps the runs along kw.
    """
    if any(padding):
        inputs = F.pad(inputs, (padding[1], padding[1], padding[0], padding[0]))
    batch, channels = inputs.shape[:2]
    groups = layer.groups
    spans = [layer.dilation[i] * (layer.kernel_size[i] - 1) + 1 for i in range(2)]
    channels_last = channels // groups > 1
    if channels_last:
        inputs = inputs.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    windows = inputs.unfold(2, spans[0], layer.stride[0]).unfold(3, spans[1], layer.stride[1])
    windows = windows[..., :: layer.dilation[0], :: layer.dilation[1]]
    rows, columns = windows.shape[2:4]
    # [B, G, C/G, rows, columns, kh, kw]
    windows = windows.reshape(batch, groups, channels // groups, rows, columns, *layer.kernel_size)
    order = (0, 1, 3, 4, 5, 6, 2) if channels_last else (0, 1, 3, 4, 2, 5, 6)
    return windows.permute(order).reshape(batch, groups, rows * columns, -1)


def _summed(tensors: Iterable[Tensor]) -> Tensor:
    """The sum of one or more tensors (one is returned as it is, not copied by adding it to 0)."""
    return functools.reduce(torch.add, tensors)


def _joined(tensors: list[Tensor], dim: int) -> Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


@register_rule(nn.Conv2d)
def conv2d_rule(
    layer: nn.Conv2d, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """Conv2d (any stride, padding, padding mode, dilation, groups), per layer by the cheaper path.

    The weight acts as a matrix product on the input windows of each group.
    Instantiation: the per-example weight gradients come from the native
    convolution weight-gradient kernel, run once with the batch folded into
    the groups. Ghost norm: from the Gram matrices of the input windows and
    output gradients; the clipped sum is then the native weight-gradient
    kernel on the output gradients scaled by the clip factors.
    """
    result = {}
    if "weight" in params:
        weight = params["weight"]
        positions = calls[0].output_grad[0, 0].numel() * len(calls)
        in_features, out_features = weight[0].numel(), layer.out_channels // layer.groups
        if instantiation_is_cheaper(positions, in_features, out_features):
            result["weight"] = instantiated(_summed(per_example_conv_weight_gradients(layer, call) for call in calls))
            return result | _conv_bias(params, calls)
        windows = _joined([patches(layer, *_conv_input(layer, call.input)) for call in calls], 2)
        output_grads = _joined(
            [call.output_grad.reshape(batch_size, layer.groups, out_features, -1) for call in calls], 3,
        )
        result["weight"] = ParameterGradients(
            ghost_squared_norms(output_grads, windows),
            lambda factors: _summed(conv_weight_gradient(layer, call, weight, factors) for call in calls),
            "ghost",
        )
    return result | _conv_bias(params, calls)


def conv_weight_gradient(layer: nn.Conv2d, call: LayerCall, weight: Tensor, factors: Tensor) -> Tensor:
    """The sum over examples of factor_i times example i's Conv2d weight gradient, for one call.

    The native weight-gradient kernel on the output gradients scaled by the
    factors; ``weight`` only gives the kernel its shape.
    """
    inputs, padding = _conv_input(layer, call.input)
    _, gradient, _ = torch.ops.aten.convolution_backward(
        _scaled(call.output_grad, factors), inputs, weight, None, layer.stride, padding, layer.dilation,
        False, (0, 0), layer.groups, (False, True, False),
    )
    return gradient


def _conv_bias(params: Mapping[str, Tensor], calls: list[LayerCall]) -> dict[str, ParameterGradients]:
    if "bias" not in params:
        return {}
    return {"bias": instantiated(_summed(call.output_grad.flatten(2).sum(2) for call in calls))}


def per_example_conv_weight_gradients(layer: nn.Conv2d, call: LayerCall) -> Tensor:
    """Each example's gradient of a Conv2d weight for one call, [B, *weight.shape].

    The batch is folded into the channels and the groups (B * groups groups),
    so one call of the native weight-gradient kernel yields every example's
    gradient; the weight argument only gives that kernel its shape.
    """
    inputs, padding = _conv_input(layer, call.input)
    batch, channels = inputs.shape[:2]
    output_grad = call.output_grad
    weight_shape = (batch * layer.out_channels, channels // layer.groups, *layer.kernel_size)
    _, gradients, _ = torch.ops.aten.convolution_backward(
        output_grad.reshape(1, batch * layer.out_channels, *output_grad.shape[2:]),
        inputs.reshape(1, batch * channels, *inputs.shape[2:]),
        inputs.new_empty(weight_shape),
        None, layer.stride, padding, layer.dilation, False, (0, 0), batch * layer.groups, (False, True, False),
    )
    return gradients.view(batch, layer.out_channels, channels // layer.groups, *layer.kernel_size)


@register_rule(nn.Embedding, supports=lambda layer: layer.max_norm is None and not layer.scale_grad_by_freq)
def embedding_rule(
    layer: nn.Embedding, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """Embedding ghost norm: ||G_i||^2 = sum over position pairs with the same index of g_t . g_s."""
    indices = _joined([call.input.reshape(batch_size, -1) for call in calls], 1)
    output_grads = _joined([call.output_grad.reshape(batch_size, -1, layer.embedding_dim) for call in calls], 1)
    if layer.padding_idx is not None:
        output_grads = output_grads.masked_fill((indices == layer.padding_idx).unsqueeze(2), 0.0)
    same_index = indices.unsqueeze(2) == indices.unsqueeze(1)
    gram = torch.bmm(output_grads, output_grads.transpose(1, 2))
    squared = torch.where(same_index, gram, 0.0).flatten(1).sum(1)

    def weight_sum(factors: Tensor) -> Tensor:
        weighted = _scaled(output_grads, factors).reshape(-1, layer.embedding_dim)
        return torch.zeros_like(params["weight"]).index_add_(0, indices.reshape(-1), weighted)

    return {"weight": ParameterGradients(squared, weight_sum, "ghost")}


def _affine_gradients(
    params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int, normalize: Callable[[Tensor], Tensor],
    reduce: Callable[[Tensor], Tensor],
) -> dict[str, ParameterGradients]:
    """Per-example gradients of a normalisation layer's elementwise affine: weight sum(g * x_hat), bias sum(g)."""
    result = {}
    if "weight" in params:
        result["weight"] = instantiated(
            _summed(reduce(normalize(call.input) * call.output_grad) for call in calls).reshape(
                batch_size, *params["weight"].shape
            )
        )
    if "bias" in params:
        result["bias"] = instantiated(
            _summed(reduce(call.output_grad) for call in calls).reshape(batch_size, *params["bias"].shape)
        )
    return result


@register_rule(nn.GroupNorm)
def group_norm_rule(
    layer: nn.GroupNorm, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """GroupNorm affine parameters, per channel: sums over each example's positions."""
    return _affine_gradients(
        params, calls, batch_size,
        normalize=lambda x: F.group_norm(x, layer.num_groups, eps=layer.eps),
        reduce=lambda t: t.reshape(batch_size, layer.num_channels, -1).sum(2),
    )


@register_rule(nn.LayerNorm)
def layer_norm_rule(
    layer: nn.LayerNorm, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """LayerNorm affine parameters: sums over each example's positions outside the normalised shape."""
    normalized_size = math.prod(layer.normalized_shape)
    return _affine_gradients(
        params, calls, batch_size,
        normalize=lambda x: F.layer_norm(x, layer.normalized_shape, eps=layer.eps),
        reduce=lambda t: t.reshape(batch_size, -1, normalized_size).sum(1),
    )


# ---------------------------------------------------------------------------
# The vmap fallback, per module

BatchDims = tuple[tuple[Any, ...], dict[str, Any], list[int | None]]
"""Where each positional argument, keyword argument and output has its examples (None: not batched)."""


def _leading_batch_dims(layer: nn.Module, call: LayerCall, batch_size: int) -> BatchDims:
    def dim_of(value: Any) -> int | None:
        return 0 if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch_size else None

    output_dims = []
    for slot in call.outputs:
        if slot is not None and slot.grad is not None and (len(slot.shape) == 0 or slot.shape[0] != batch_size):
            raise WholeModelFallback(
                f"{type(layer).__name__} has an output of shape {tuple(slot.shape)} without the batch "
                f"of {batch_size} along dimension 0"
            )
        output_dims.append(0 if slot is not None and slot.grad is not None else None)
    return (
        tuple(dim_of(arg) for arg in call.args),
        {name: dim_of(value) for name, value in call.kwargs.items()},
        output_dims,
    )


_ATTENTION_ARGUMENTS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


def _attention_batch_dims(layer: nn.MultiheadAttention, call: LayerCall, batch_size: int) -> BatchDims:
    sequence_first = {"query": 0, "key": 0, "value": 0} if layer.batch_first else {"query": 1, "key": 1, "value": 1}
    dims = {**sequence_first, "key_padding_mask": 0}
    mask = dict(zip(_ATTENTION_ARGUMENTS, call.args)).get("attn_mask", call.kwargs.get("attn_mask"))
    if mask is not None and mask.dim() == 3:
        raise WholeModelFallback("nn.MultiheadAttention is given a per-example (3-D) attn_mask")

    def dim_of(name: str, value: Any) -> int | None:
        return dims.get(name) if isinstance(value, Tensor) else None

    # Outputs: the attention output, then the attention weights [B, L, S] when asked for.
    output_dims = [dims["query"], 0]
    return (
        tuple(dim_of(name, arg) for name, arg in zip(_ATTENTION_ARGUMENTS, call.args)),
        {name: dim_of(name, value) for name, value in call.kwargs.items()},
        [dim if slot is not None and slot.grad is not None else None for dim, slot in zip(output_dims, call.outputs)],
    )


def vmap_rule(
    layer: nn.Module,
    params: Mapping[str, Tensor],
    calls: list[LayerCall],
    batch_size: int,
    batch_dims: Callable[[nn.Module, LayerCall, int], BatchDims] = _leading_batch_dims,
) -> dict[str, ParameterGradients]:
    """Per-example gradients of one module's parameters by torch.func over that module alone.

    For each recorded call, vmap over examples of the gradient of
    <module(x_i), dL/dy_i>, the vector-Jacobian product of the module's
    output with the recorded output gradient. Summed over calls, instantiated.
    """
    per_example: dict[str, Tensor] = {}
    for call in calls:
        argument_dims, keyword_dims, output_dims = batch_dims(layer, call, batch_size)
        output_grads = [slot.grad if dim is not None else None for slot, dim in zip(call.outputs, output_dims)]

        def output_dot(weights, args, kwargs, grads):
            args = tuple(arg if dim is None else arg.unsqueeze(dim) for arg, dim in zip(args, argument_dims))
            kwargs = {name: value if keyword_dims[name] is None else value.unsqueeze(keyword_dims[name])
                      for name, value in kwargs.items()}
            outputs = tree_flatten(functional_call(layer, weights, args, kwargs))[0]
            return sum(
                (output * gradient.unsqueeze(dim)).sum()
                for output, gradient, dim in zip(outputs, grads, output_dims)
                if gradient is not None
            )

        try:
            gradients = vmap(
                grad(output_dot), in_dims=(None, argument_dims, keyword_dims, output_dims), randomness="error"
            )(dict(params), call.args, call.kwargs, output_grads)
        except RuntimeError as error:
            raise WholeModelFallback(
                f"torch.func cannot take per-example gradients of {type(layer).__name__} alone "
                f"({str(error).splitlines()[0]})"
            ) from error
        for name, gradient in gradients.items():
            per_example[name] = per_example[name] + gradient if name in per_example else gradient
    return {name: instantiated(gradient) for name, gradient in per_example.items()}


@register_rule(nn.MultiheadAttention, supports=lambda layer: not (layer.training and layer.dropout > 0))
def attention_rule(
    layer: nn.MultiheadAttention, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """nn.MultiheadAttention: the vmap fallback, told where ``batch_first`` puts the examples.

    Attention runs on PyTorch's math kernel here: the fused kernels (flash,
    memory-efficient) have no vmap batching rule, so torch.func would run
    them once per example (on a GPU, one kernel launch per example per layer).
    """
    with sdpa_kernel(SDPBackend.MATH):
        return vmap_rule(layer, params, calls, batch_size, _attention_batch_dims)


# ---------------------------------------------------------------------------
# Recording one forward and backward pass


@dataclass(frozen=True)
class _Unit:
    """A module whose trainable parameters (``names``, relative to it) one rule covers."""

    prefix: str
    layer: nn.Module
    rule: LayerRule
    names: tuple[str, ...]

    def qualified(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    @property
    def title(self) -> str:
        """The layer's name and type, as the run log shows it."""
        return f"{self.prefix or '(model)'} ({type(self.layer).__name__})"


def _units(model: nn.Module) -> list[_Unit]:
    units: list[_Unit] = []

    def visit(prefix: str, module: nn.Module) -> None:
        names = tuple(name for name, parameter in module.named_parameters() if parameter.requires_grad)
        if not names:
            return
        rule = rule_for(module)
        owns_parameters = any(p.requires_grad for p in module.parameters(recurse=False))
        if rule is not None or owns_parameters:
            units.append(_Unit(prefix, module, rule or vmap_rule, names))
            return
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)

    visit("", model)
    return units


def _unsupported_reason(model: nn.Module, units: list[_Unit]) -> str | None:
    names_of: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if parameter.requires_grad:
            names_of.setdefault(id(parameter), []).append(name)
    tied = [" = ".join(names) for names in names_of.values() if len(names) > 1]
    if tied:
        return f"parameter {'; '.join(tied)} is tied to several modules"
    for unit in units:
        if isinstance(unit.layer, nn.MultiheadAttention) and unit.rule is vmap_rule:
            return f"{unit.prefix or 'the model'} (nn.MultiheadAttention) uses attention dropout in training mode"
    return None


class _GradientTap(torch.autograd.Function):
    """Identity on a first layer's output (which needs no grad) that gives it a place in the backward pass.

    The backward pass is asked for the gradient of ``anchor``, the one leaf
    that requires grad; on the way each tap records the gradient at its output.
    """

    @staticmethod
    def forward(ctx, output: Tensor, anchor: Tensor, slot: OutputSlot) -> Tensor:
        ctx.slot = slot
        # detach() aliases the storage without copying and without making a view
        # autograd tracks, so later in-place operations on the result are allowed.
        return output.detach()

    @staticmethod
    def backward(ctx, gradient: Tensor) -> tuple[None, Tensor, None]:
        ctx.slot.keep(gradient)
        return None, gradient.new_zeros(()), None


def _recorder(calls: list[LayerCall], anchor: Tensor) -> Callable:
    def record(layer: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        leaves, spec = tree_flatten(output)
        slots: list[OutputSlot | None] = []
        tapped = False
        for index, leaf in enumerate(leaves):
            if not (isinstance(leaf, Tensor) and leaf.is_floating_point()):
                slots.append(None)
                continue
            slot = OutputSlot(leaf.shape, leaf.dtype, leaf.device)
            if leaf.requires_grad:
                # A hook registered before any in-place change of the output
                # receives the gradient at the value the layer produced.
                leaf.register_hook(slot.keep)
            else:
                leaves[index] = _GradientTap.apply(leaf, anchor, slot)
                tapped = True
            slots.append(slot)
        versions = tuple(t._version for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor))
        calls.append(LayerCall(args, kwargs, slots, versions))
        return tree_unflatten(leaves, spec) if tapped else None

    return record


# Reading a parameter's metadata, or a detached copy of it, carries no gradient.
GRADIENT_FREE_OPERATIONS = frozenset({
    ".dtype", ".shape", ".device", ".requires_grad", ".is_cuda", ".ndim", ".layout", ".is_sparse",
    "size", "dim", "numel", "detach", "is_floating_point", "is_complex",
})


class _ParameterUseTracker(TorchFunctionMode):
    """Notes every trainable parameter that an operation uses while the unit whose rule covers it is not running.

    Such a use (``h @ self.emb.weight.T`` in a model's forward, a weight read by
    a sibling module) contributes gradient that no rule sees. ``owners`` maps
    id() of each parameter tensor given to ``functional_call`` to its unit's index.
    """

    def __init__(self, owners: dict[int, int], names: dict[int, str]) -> None:
        super().__init__()
        self.owners = owners
        self.names = names
        self.running = [0] * (max(owners.values(), default=-1) + 1)
        self.in_model = False
        self.outside: dict[str, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _operation_name(func)
        if self.in_model and name not in GRADIENT_FREE_OPERATIONS:
            for leaf in tree_flatten((args, kwargs))[0]:
                unit = self.owners.get(id(leaf)) if isinstance(leaf, Tensor) else None
                if unit is not None and not self.running[unit]:
                    self.outside.setdefault(self.names[id(leaf)], name)
        return func(*args, **kwargs)

    def watch(self, model: nn.Module, units: list[_Unit]) -> list:
        """Hooks that keep ``running`` and ``in_model`` up to date; returns their handles."""

        def entering(index: int) -> Callable:
            def pre_hook(*_):
                self.running[index] += 1
            return pre_hook

        def leaving(index: int) -> Callable:
            def hook(*_):
                self.running[index] -= 1
            return hook

        def set_in_model(value: bool) -> Callable:
            def hook(*_):
                self.in_model = value
            return hook

        handles = [model.register_forward_pre_hook(set_in_model(True)),
                   model.register_forward_hook(set_in_model(False))]
        for index, unit in enumerate(units):
            handles.append(unit.layer.register_forward_pre_hook(entering(index)))
            handles.append(unit.layer.register_forward_hook(leaving(index)))
        return handles


def _operation_name(func: Callable) -> str:
    """A torch operation's name; a property such as ``Tensor.T`` is named by the property."""
    name = getattr(func, "__name__", str(func))
    if name == "__get__":
        return f".{getattr(getattr(func, '__self__', None), '__name__', 'attribute')}"
    return name


def per_example_losses(loss_fn: clipping.LossFunction, logits: Tensor, labels: Tensor) -> Tensor:
    """Each example's loss [B], as ``loss_fn(logits[i:i+1], labels[i:i+1])`` defines it.

    F.cross_entropy and F.nll_loss on one example average over a batch of one
    (and over any further positions), so they run once with reduction="none";
    other losses go through vmap, one example at a time.
    """
    if loss_fn in (F.cross_entropy, F.nll_loss):
        losses = loss_fn(logits, labels, reduction="none")
        return losses.flatten(1).mean(1) if losses.dim() > 1 else losses
    return vmap(lambda logit, label: loss_fn(logit.unsqueeze(0), label.unsqueeze(0)))(logits, labels)


def _record(
    model: nn.Module, units: list[_Unit], params: dict[str, Tensor], inputs: Tensor, labels: Tensor,
    loss_fn: clipping.LossFunction, tracker: _ParameterUseTracker | None = None,
) -> list[list[LayerCall]]:
    """Run the forward and the one backward pass; return each unit's recorded calls.

    With a ``tracker``, the forward runs under it, which notes parameters used
    outside their units.
    """
    calls: list[list[LayerCall]] = [[] for _ in units]
    anchor = torch.zeros((), dtype=torch.float32, device=inputs.device, requires_grad=True)
    handles = [unit.layer.register_forward_hook(_recorder(calls[i], anchor), with_kwargs=True)
               for i, unit in enumerate(units)]
    if tracker is not None:
        handles += tracker.watch(model, units)
    try:
        with torch.enable_grad(), tracker or contextlib.nullcontext():
            loss = per_example_losses(loss_fn, functional_call(model, params, (inputs,)), labels).sum()
    finally:
        for handle in handles:
            handle.remove()
    if loss.requires_grad:
        torch.autograd.grad(loss, anchor)
    for unit, unit_calls in zip(units, calls, strict=True):
        for call in unit_calls:
            now = tuple(t._version for t in tree_flatten((call.args, call.kwargs))[0] if isinstance(t, Tensor))
            if now != call.versions:
                raise WholeModelFallback(
                    f"an input of {unit.prefix or 'the model'} ({type(unit.layer).__name__}) is changed in place "
                    "after the layer has run"
                )
    return calls


def _rule_gradients(
    units: list[_Unit], calls: list[list[LayerCall]], params: Mapping[str, Tensor], batch_size: int
) -> dict[str, ParameterGradients]:
    """Every rule's ParameterGradients for the recorded calls, by qualified parameter name."""
    gradients: dict[str, ParameterGradients] = {}
    for unit, unit_calls in zip(units, calls, strict=True):
        if unit_calls:
            local = {name: params[unit.qualified(name)] for name in unit.names}
            for name, parameter_gradients in unit.rule(unit.layer, local, unit_calls, batch_size).items():
                gradients[unit.qualified(name)] = parameter_gradients
    return gradients


# ---------------------------------------------------------------------------
# The check, once per model


RULE_CHECK_TOLERANCE = 1e-5
RULE_CHECK_EXAMPLES = 4
# Per-example gradient entries the vmap fallback holds at once (see fallback_physical_batch).
VMAP_FALLBACK_GRADIENT_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class EnginePlan:
    """How the fast engine computes one model's clipped sums, decided by ``check_rules``.

    ``fallback`` is the reason the whole model runs on the vmap engine, or
    None; ``layers`` pairs each layer's title with how its gradients are
    computed: "fast (ghost)", "fast (per-example)" or "vmap (fallback: why)".
    """

    fallback: str | None
    layers: tuple[tuple[str, str], ...]

    def describe(self) -> list[str]:
        """One line per layer, for the run log."""
        return [f"{title}: {how}" for title, how in self.layers]


_PLANS: weakref.WeakKeyDictionary[nn.Module, EnginePlan] = weakref.WeakKeyDictionary()


def engine_plan(model: nn.Module) -> EnginePlan | None:
    """The plan the fast engine settled on for ``model``, or None before its first call with examples."""
    return _PLANS.get(model)


def _whole_model_fallback(units: list[_Unit], reason: str) -> EnginePlan:
    return EnginePlan(reason, tuple((unit.title, f"vmap (fallback: {reason})") for unit in units))


def _mismatch(actual: Tensor, expected: Tensor, scale: float) -> bool:
    return (actual - expected).norm().item() > RULE_CHECK_TOLERANCE * max(expected.norm().item(), 1e-6 * scale)


@clipping.in_ieee_float32
def check_rules(
    model: nn.Module, flat_weights: Tensor, inputs: Tensor, labels: Tensor, loss_fn: clipping.LossFunction,
) -> EnginePlan | None:
    """Show on a few examples that the rules see each parameter's whole per-example gradient, in float64.

    On a float64 copy of the model, and with the random generator replayed so
    that dropout draws the same masks, the rules' gradients are compared with
    autograd's: each example's own gradient (the clipped sum with a one-hot
    factor, and its squared norm) and the sum over examples, each to relative
    ``RULE_CHECK_TOLERANCE``. Independently, every operation of the forward
    pass is watched for a parameter used outside the layer whose rule covers
    it (a functionally tied weight, a weight read by another module). Any
    failure, or a model the per-layer view cannot serve, yields a plan that
    runs the whole model on the vmap engine, with the reason naming the
    parameter. Returns None, deciding nothing, when an example's gradient is
    not finite. The generator's state is left as it was found.
    """
    units = _units(model)
    reason = _unsupported_reason(model, units)
    if reason is not None:
        return _whole_model_fallback(units, reason)
    reference = copy.deepcopy(model).to(torch.float64)
    reference_units = _units(reference)
    _, params, _ = clipping.functional_parameters(reference, flat_weights, clipping.device_of(reference))
    inputs = inputs.to(clipping.device_of(reference))
    inputs = inputs.to(torch.float64) if inputs.is_floating_point() else inputs
    labels = labels.to(inputs.device)
    labels = labels.to(torch.float64) if labels.is_floating_point() else labels
    owner_of = {reference_unit.qualified(name): index
                for index, reference_unit in enumerate(reference_units) for name in reference_unit.names}
    tracker = _ParameterUseTracker({id(params[name]): owner_of[name] for name in params},
                                   {id(params[name]): name for name in params})
    random_state = _random_state()
    try:
        try:
            calls = _record(reference, reference_units, params, inputs, labels, loss_fn, tracker)
            with torch.no_grad():
                gradients = _rule_gradients(reference_units, calls, params, inputs.shape[0])
        except WholeModelFallback as fallback:
            return _whole_model_fallback(units, str(fallback))
        if tracker.outside:
            used = "; ".join(f"{name} (by {operation})" for name, operation in tracker.outside.items())
            return _whole_model_fallback(units, f"the model's forward uses {used} outside the layer that owns it")

        def expected(summed: bool = False) -> Iterator[dict[str, Tensor]]:
            _restore_random_state(random_state)
            return _autograd_gradients(reference, params, inputs, labels, loss_fn, summed)

        squared_total = sum(gradient.square().sum().item() for row in expected() for gradient in row.values())
        if not math.isfinite(squared_total):
            return None
        wrong = _disagreeing_parameters(params, gradients, expected, inputs.shape[0], math.sqrt(squared_total))
    finally:
        _restore_random_state(random_state)
    if wrong:
        return _whole_model_fallback(
            units, f"the layer rules do not reproduce autograd's per-example gradient of {', '.join(wrong)}"
        )
    return EnginePlan(None, tuple((unit.title, _how(unit, gradients)) for unit in reference_units))


def _how(unit: _Unit, gradients: Mapping[str, ParameterGradients]) -> str:
    if unit.rule is vmap_rule or unit.rule is attention_rule:
        return f"vmap (fallback: no book-keeping rule for {type(unit.layer).__name__})"
    paths = {gradients[unit.qualified(name)].path for name in unit.names if unit.qualified(name) in gradients}
    return "fast (ghost)" if "ghost" in paths else "fast (per-example)"


def _autograd_gradients(
    model: nn.Module, params: Mapping[str, Tensor], inputs: Tensor, labels: Tensor, loss_fn: clipping.LossFunction,
    summed: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Autograd's gradients by name: each example's in turn, or with ``summed`` the one of the summed loss.

    One batched forward, then one backward pass per example (or one in all).
    Yielded one at a time, so that a check holds one gradient of a large
    model, not one per example.
    """
    leaves = {name: value.detach().requires_grad_() for name, value in params.items()}
    with torch.enable_grad():
        # Unbound here: a view taken under the caller's no_grad would have no graph.
        losses = per_example_losses(loss_fn, functional_call(model, leaves, (inputs,)), labels)
        losses = [losses.sum()] if summed else losses.unbind(0)
    for loss in losses:
        grads = torch.autograd.grad(loss, list(leaves.values()), retain_graph=not summed, allow_unused=True)
        yield {name: torch.zeros_like(leaf) if gradient is None else gradient
               for (name, leaf), gradient in zip(leaves.items(), grads, strict=True)}


def _disagreeing_parameters(
    params: Mapping[str, Tensor], gradients: Mapping[str, ParameterGradients],
    expected: Callable[..., Iterator[dict[str, Tensor]]], batch_size: int, scale: float,
) -> list[str]:
    """The parameters whose rule misses autograd's per-example gradient, its squared norm or the summed loss's.

    ``expected()`` yields autograd's gradients example by example,
    ``expected(summed=True)`` the summed loss's; ``scale`` (the norm of all
    the examples' gradients together) sets the tolerance's unit.
    """
    wrong: set[str] = set()
    with torch.no_grad():
        for index, row in enumerate(expected()):
            for name, value in params.items():
                rule = gradients.get(name)
                if rule is None:
                    if row[name].norm().item() > 1e-6 * scale:
                        wrong.add(name)
                    continue
                one_hot = torch.zeros(batch_size, dtype=value.dtype, device=value.device)
                one_hot[index] = 1
                if (_mismatch(rule.clipped_sum(one_hot), row[name], scale)
                        or _mismatch(rule.squared_norms[index].reshape(1), row[name].square().sum().reshape(1),
                                     scale**2)):
                    wrong.add(name)
        for total in expected(summed=True):
            for name, rule in gradients.items():
                ones = torch.ones(batch_size, dtype=total[name].dtype, device=total[name].device)
                if name in total and _mismatch(rule.clipped_sum(ones), total[name], scale):
                    wrong.add(name)
    return [name for name in params if name in wrong]


def _random_state() -> tuple[Tensor, list[Tensor] | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _restore_random_state(state: tuple[Tensor, list[Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


# ---------------------------------------------------------------------------
# The engine


@clipping.in_ieee_float32
def fast_clipped_sum(
    model: nn.Module,
    flat_weights: Tensor,
    inputs: Tensor,
    labels: Tensor,
    clip_norm: clipping.ClipNorm,
    max_physical_batch: int,
    loss_fn: clipping.LossFunction = F.cross_entropy,
    return_norms: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """Sum over examples of each example's gradient clipped to L2 norm ``clip_norm``, by book-keeping.

    Same arguments, result and guarantees as
    ``workers.clipping.per_example_clipped_sum``: a 1-D float32 tensor laid out
    as ``flat_parameters``, zeros when there are no examples; an example whose
    gradient is not finite contributes exactly zero (its norm is returned as
    it came out, not finite); the model's parameters and their ``.grad`` are
    neither used nor changed (hooks are added to its modules for the duration
    of the call only). With ``return_norms`` it also returns, per trainable
    parameter name, the [n] per-example L2 norms of that parameter's gradient,
    before clipping.

    The first call with examples checks the rules on this model
    (``check_rules``); a model they cannot serve runs on the vmap engine from
    then on, with one warning that says why (``engine_plan`` tells).
    """
    clipping.check_arguments(model, flat_weights, inputs, labels, clip_norm, max_physical_batch)
    device = clipping.device_of(model)
    trainable = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    if not trainable:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return (empty, {}) if return_norms else empty
    plan = _PLANS.get(model)
    vmap_physical_batch = fallback_physical_batch(max_physical_batch, sum(p.numel() for _, p in trainable))
    if plan is None and inputs.shape[0]:
        plan = check_rules(model, flat_weights, inputs[:RULE_CHECK_EXAMPLES], labels[:RULE_CHECK_EXAMPLES], loss_fn)
        if plan is None:
            # Nothing shown yet: this call runs on the vmap engine and the next one checks again.
            return clipping.per_example_clipped_sum(model, flat_weights, inputs, labels, clip_norm,
                                                    vmap_physical_batch, loss_fn, return_norms)
        _PLANS[model] = plan
        if plan.fallback is not None:
            _warn_fallback(plan.fallback)
    if plan is None or plan.fallback is None:
        try:
            return _book_keeping(model, _units(model), trainable, flat_weights, inputs, labels, clip_norm,
                                 max_physical_batch, loss_fn, return_norms, device)
        except WholeModelFallback as fallback:
            _PLANS[model] = plan = _whole_model_fallback(_units(model), str(fallback))
            _warn_fallback(plan.fallback)
    return clipping.per_example_clipped_sum(model, flat_weights, inputs, labels, clip_norm, vmap_physical_batch,
                                            loss_fn, return_norms)


def fallback_physical_batch(max_physical_batch: int, trainable_elements: int) -> int:
    """How many examples the vmap fallback takes at a time: ``max_physical_batch``, fewer for a large model.

    ``max_physical_batch`` is chosen for the fast engine, which never holds a
    whole per-example gradient. The vmap engine holds one per example, so a
    chunk is also capped at ``VMAP_FALLBACK_GRADIENT_ELEMENTS`` gradient
    entries in all (128 MiB of float32): past that, memory traffic makes a
    step slower, not faster.
    """
    return max(1, min(max_physical_batch, VMAP_FALLBACK_GRADIENT_ELEMENTS // max(1, trainable_elements)))


def _warn_fallback(reason: str) -> None:
    warnings.warn(f"fast clipping engine: {reason}; computing this model's clipped sum with the vmap engine",
                  stacklevel=4)


def _book_keeping(
    model: nn.Module, units: list[_Unit], trainable: list[tuple[str, nn.Parameter]], flat_weights: Tensor,
    inputs: Tensor, labels: Tensor, clip_norm: clipping.ClipNorm, max_physical_batch: int, loss_fn: clipping.LossFunction,
    return_norms: bool, device: torch.device,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    weights = flat_weights.detach().to(device=device, dtype=torch.float32)
    params = {
        name: chunk.view(parameter.shape).to(parameter.dtype)
        for (name, parameter), chunk in zip(trainable, torch.split(weights, [p.numel() for _, p in trainable]),
                                            strict=True)
    }
    flat = torch.zeros(weights.shape, dtype=torch.float32, device=device)
    # Each parameter's sum accumulates in its own slice of the result.
    sums = {
        name: chunk.view(parameter.shape)
        for (name, parameter), chunk in zip(trainable, torch.split(flat, [p.numel() for _, p in trainable]),
                                            strict=True)
    }
    norms = torch.zeros(len(sums), inputs.shape[0], device=device)
    inputs, labels = inputs.to(device), labels.to(device)
    for start in range(0, inputs.shape[0], max_physical_batch):
        # Positions in the batch of the examples still taking part in this chunk.
        positions = torch.arange(start, min(start + max_physical_batch, inputs.shape[0]), device=device)
        while positions.numel():
            calls = _record(model, units, params, inputs[positions], labels[positions], loss_fn)
            # The recorded inputs are part of the forward graph; nothing below is to be differentiated.
            with torch.no_grad():
                gradients = _rule_gradients(units, calls, params, positions.numel())
                squared = torch.stack([
                    gradients[name].squared_norms.to(torch.float32) if name in gradients
                    else torch.zeros(positions.numel(), device=device)
                    for name in sums
                ])
                norms[:, positions] = squared.sqrt()
                finite = squared.sum(0).isfinite()
                if not finite.all():
                    # Batched clipped sums would carry a non-finite gradient into every entry it touches,
                    # even at factor 0: the chunk runs again without the examples that have one.
                    positions = positions[finite]
                    continue
                factors = clipping.clip_factors_by_parameter(dict(zip(sums, squared)), clip_norm)
                for name, parameter_gradients in gradients.items():
                    sums[name] += parameter_gradients.clipped_sum(factors[name])
            break
    if not return_norms:
        return flat
    return flat, dict(zip(sums, norms))


# Registers the rules for recurrent layers and EmbeddingBag; imported last because they build on this module.
from workers import sequence_rules  # noqa: E402, F401
