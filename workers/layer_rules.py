"""The fast engine's per-layer rules: one function per layer type, registered by decorator, and their records.

A rule turns what one forward and one backward pass recorded for a layer (its
inputs, and the loss gradient at its outputs) into, per parameter, each
example's squared gradient norm and a function that forms the sum of the
per-example gradients weighted by clip factors. It does so either by a ghost
norm (from two Gram matrices, never forming the per-example gradients) or by
instantiating the per-example gradients, whichever costs less for the layer's
shape (``instantiation_is_cheaper``).

This module holds the registry (``register_rule``, ``register_rule_by_name``,
``rule_for``), the shared math, the rules for Linear, Conv2d, Embedding,
GroupNorm, LayerNorm, RMSNorm and MultiheadAttention, and ``vmap_rule``, the
torch.func fallback for one module. ``workers.sequence_rules`` registers the
rules for recurrent layers and EmbeddingBag, ``workers.transformer_rules``
those for Hugging Face transformers' layers; ``workers.engines`` imports them
before it looks a rule up.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten


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
    """One tensor output of a recorded layer call and, after the backward pass, the loss gradient at it.

    ``batched`` says whether the output was computed from the model's input
    batch (see ``LayerCall``).
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    batched: bool = True
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
    ``batched_args`` (one per positional argument) and ``batched_kwargs`` (by
    name) say which arguments are tensors computed from the model's input
    batch. Parameters, buffers and constants made in ``forward`` (a shared
    positional table, an ``arange(T)``) are not, whatever their shape: the
    engine tracks this through every operation, never guesses it from a size.
    """

    args: tuple
    kwargs: dict
    outputs: list[OutputSlot | None]
    versions: tuple[int, ...]
    batched_args: tuple[bool, ...] = ()
    batched_kwargs: dict[str, bool] = field(default_factory=dict)

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
_RULES_BY_NAME: list[tuple[Callable[[type[nn.Module]], bool], _Registered]] = []


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


def register_rule_by_name(
    names_the_type: Callable[[type[nn.Module]], bool], supports: Callable[[nn.Module], bool] = lambda layer: True
) -> Callable[[LayerRule], LayerRule]:
    """Register a rule for the layer types that ``names_the_type`` accepts, judged by their module and class name.

    For the layers of a library dpfleet does not depend on (``transformers``):
    a type is recognised without importing its library, so the registration
    costs nothing and is the same whether the library is installed or not.
    A type registered by ``register_rule`` is looked up first; ``supports``
    declines a layer as there.
    """

    def add(rule: LayerRule) -> LayerRule:
        _RULES_BY_NAME.append((names_the_type, _Registered(rule, supports)))
        return rule

    return add


def rule_for(layer: nn.Module) -> LayerRule | None:
    """The registered rule for this layer, or None when it takes the vmap fallback."""
    registered = _RULES.get(type(layer)) or next(
        (registered for names_the_type, registered in _RULES_BY_NAME if names_the_type(type(layer))), None
    )
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
    return affine_map_gradients(
        params, calls, batch_size, layer.in_features, layer.out_features,
        lambda summed: summed.view(layer.out_features, layer.in_features),
    )


def affine_map_gradients(
    params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int, in_features: int, out_features: int,
    weight_layout: Callable[[Tensor], Tensor],
) -> dict[str, ParameterGradients]:
    """Per-example gradients of y = x A^T + b on [B, d] or [B, *, d] inputs, whatever layout holds the matrix A.

    A is [out_features, in_features]; ``weight_layout`` maps a sum of such
    gradients, [1, out_features, in_features], to the weight parameter's
    shape (nn.Linear holds A, transformers' Conv1D A^T). The weight takes the
    ghost norm or instantiation by ``instantiation_is_cheaper``; the bias is
    summed over positions.
    """
    inputs = _joined([call.input.reshape(batch_size, -1, in_features) for call in calls], 1)
    output_grads = _joined([call.output_grad.reshape(batch_size, -1, out_features) for call in calls], 1)
    result = {}
    if "weight" in params:
        result["weight"] = outer_product_gradients(
            output_grads.transpose(1, 2).unsqueeze(1), inputs.unsqueeze(1), weight_layout,
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


def tied_embedding_pair(units: list) -> bool:
    """Whether the modules sharing one parameter (engine units, with ``.layer`` and ``.rule``) are the pair whose
    tie ``tied_embedding_gradients`` serves: an ``nn.Embedding`` on its rule and an ``nn.Linear`` on its rule
    whose weight is the embedding's table (a language model's input embedding and output layer)."""
    if len(units) != 2:
        return False
    kinds = sorted(units, key=lambda unit: not isinstance(unit.layer, nn.Embedding))
    embedding, linear = kinds[0], kinds[1]
    return (isinstance(embedding.layer, nn.Embedding) and embedding.rule is embedding_rule
            and type(linear.layer) is nn.Linear and linear.rule is linear_rule
            and linear.layer.weight is embedding.layer.weight)


def tied_embedding_gradients(
    embedding: nn.Embedding, embedding_calls: list[LayerCall], linear_calls: list[LayerCall], batch_size: int,
    of_embedding: ParameterGradients, of_linear: ParameterGradients,
) -> ParameterGradients:
    """An embedding table W [V, d] that an ``nn.Linear`` also uses as its weight: each example's gradient is the
    sum of the two uses' gradients, never formed.

    With E_i = sum_t e_{x_t} g_t^T (the embedding's use: index x_t, output
    gradient g_t) and L_i = sum_s delta_s h_s^T (the linear use: input h_s,
    output gradient delta_s in R^V), ||E_i + L_i||^2 = ||E_i||^2 + ||L_i||^2 +
    2 <E_i, L_i>, and <E_i, L_i> = sum_{t,s} delta_s[x_t] (g_t . h_s): a
    [T, S] product per example. The clipped sum is the two uses' clipped sums added.
    """
    indices = _joined([call.input.reshape(batch_size, -1) for call in embedding_calls], 1)
    output_grads = _joined([call.output_grad.reshape(batch_size, -1, embedding.embedding_dim)
                            for call in embedding_calls], 1)
    if embedding.padding_idx is not None:
        output_grads = output_grads.masked_fill((indices == embedding.padding_idx).unsqueeze(2), 0.0)
    inputs = _joined([call.input.reshape(batch_size, -1, embedding.embedding_dim) for call in linear_calls], 1)
    deltas = _joined([call.output_grad.reshape(batch_size, -1, embedding.num_embeddings) for call in linear_calls], 1)
    # at_index[i, s, t] = delta_s[x_t]; products[i, s, t] = h_s . g_t
    at_index = deltas.gather(2, indices.unsqueeze(1).expand(batch_size, deltas.shape[1], indices.shape[1]))
    products = torch.bmm(inputs.to(output_grads.dtype), output_grads.transpose(1, 2))
    cross = (at_index.to(products.dtype) * products).flatten(1).sum(1)
    squared = of_embedding.squared_norms + of_linear.squared_norms + 2 * cross

    def weight_sum(factors: Tensor) -> Tensor:
        return of_embedding.clipped_sum(factors) + of_linear.clipped_sum(factors)

    return ParameterGradients(squared, weight_sum, "ghost")


def affine_gradients(
    params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int, normalize: Callable[[Tensor], Tensor],
    reduce: Callable[[Tensor], Tensor],
) -> dict[str, ParameterGradients]:
    """Per-example gradients of a normalisation layer's elementwise affine: weight sum(g * x_hat), bias sum(g).

    ``normalize`` maps a recorded input x to x_hat, as the layer computes it;
    ``reduce`` sums a product shaped like the input over each example's
    positions that share one weight entry.
    """
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
    return affine_gradients(
        params, calls, batch_size,
        normalize=lambda x: F.group_norm(x, layer.num_groups, eps=layer.eps),
        reduce=lambda t: t.reshape(batch_size, layer.num_channels, -1).sum(2),
    )


@register_rule(nn.LayerNorm)
def layer_norm_rule(
    layer: nn.LayerNorm, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """LayerNorm affine parameters: sums over each example's positions outside the normalised shape."""
    return affine_gradients(
        params, calls, batch_size,
        normalize=lambda x: F.layer_norm(x, layer.normalized_shape, eps=layer.eps),
        reduce=over_positions(batch_size, math.prod(layer.normalized_shape)),
    )


@register_rule(nn.RMSNorm)
def rms_norm_rule(
    layer: nn.RMSNorm, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """RMSNorm weight: sum over each example's positions of the output gradient times the normalised input."""
    return affine_gradients(
        params, calls, batch_size,
        normalize=lambda x: F.rms_norm(x, layer.normalized_shape, eps=layer.eps),
        reduce=over_positions(batch_size, math.prod(layer.normalized_shape)),
    )


def over_positions(batch_size: int, normalized_size: int) -> Callable[[Tensor], Tensor]:
    """The sum over each example's positions of a tensor whose last dimensions hold ``normalized_size`` entries."""
    return lambda tensor: tensor.reshape(batch_size, -1, normalized_size).sum(1)


# ---------------------------------------------------------------------------
# The vmap fallback, per module

BatchDims = tuple[tuple[Any, ...], dict[str, Any], list[int | None]]
"""Where each positional argument, keyword argument and output has its examples (None: not batched)."""


def _leading_batch_dims(layer: nn.Module, call: LayerCall, batch_size: int) -> BatchDims:
    """Dimension 0 for every argument and output that carries the batch; None for those that do not."""
    name = type(layer).__name__

    def dim_of(value: Any, batched: bool) -> int | None:
        if not (batched and isinstance(value, Tensor)):
            return None
        if value.dim() == 0 or value.shape[0] != batch_size:
            raise WholeModelFallback(
                f"{name} is given a tensor of shape {tuple(value.shape)} computed from the batch, without the "
                f"batch of {batch_size} along dimension 0"
            )
        return 0

    return (
        tuple(dim_of(arg, batched) for arg, batched in zip(call.args, call.batched_args, strict=True)),
        {key: dim_of(value, call.batched_kwargs[key]) for key, value in call.kwargs.items()},
        _output_dims(name, call, batch_size, [0] * len(call.outputs)),
    )


def _output_dims(name: str, call: LayerCall, batch_size: int, dims: list[int]) -> list[int | None]:
    """``dims`` for the outputs the loss depends on (None for the others); refused when one lacks the batch there.

    An output that is not computed from the batch (a layer applied to a
    shared table) has one gradient for all examples together, from which no
    rule can take any one example's.
    """
    output_dims: list[int | None] = []
    for slot, dim in zip(call.outputs, dims):
        if slot is None or slot.grad is None:
            output_dims.append(None)
            continue
        if not slot.batched:
            raise WholeModelFallback(
                f"{name} has an output of shape {tuple(slot.shape)} that is not computed from the batch (a table "
                "shared by all examples), so no example's own gradient at it is recorded"
            )
        if len(slot.shape) <= dim or slot.shape[dim] != batch_size:
            raise WholeModelFallback(
                f"{name} has an output of shape {tuple(slot.shape)} without the batch of {batch_size} along "
                f"dimension {dim}"
            )
        output_dims.append(dim)
    return output_dims


_ATTENTION_ARGUMENTS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


def _attention_batch_dims(layer: nn.MultiheadAttention, call: LayerCall, batch_size: int) -> BatchDims:
    """Where ``batch_first`` puts the examples of query, key and value; None for a key or value shared by all."""
    sequence_first = {"query": 0, "key": 0, "value": 0} if layer.batch_first else {"query": 1, "key": 1, "value": 1}
    dims = {**sequence_first, "key_padding_mask": 0}
    mask = dict(zip(_ATTENTION_ARGUMENTS, call.args)).get("attn_mask", call.kwargs.get("attn_mask"))
    if mask is not None and mask.dim() == 3:
        raise WholeModelFallback("nn.MultiheadAttention is given a per-example (3-D) attn_mask")
    arguments = dict(zip(_ATTENTION_ARGUMENTS, zip(call.args, call.batched_args)))
    arguments |= {name: (value, call.batched_kwargs[name]) for name, value in call.kwargs.items()}
    if not arguments["query"][1]:
        raise WholeModelFallback("nn.MultiheadAttention is given a query that is not computed from the batch")

    def dim_of(name: str, value: Any, batched: bool) -> int | None:
        if not (batched and isinstance(value, Tensor)) or name not in dims:
            return None
        if value.dim() <= dims[name] or value.shape[dims[name]] != batch_size:
            raise WholeModelFallback(
                f"nn.MultiheadAttention (batch_first={layer.batch_first}) is given a {name} of shape "
                f"{tuple(value.shape)} without the batch of {batch_size} along dimension {dims[name]}"
            )
        return dims[name]

    # Outputs: the attention output, then the attention weights [B, L, S] when asked for.
    return (
        tuple(dim_of(name, *arguments[name]) for name, _ in zip(_ATTENTION_ARGUMENTS, call.args)),
        {name: dim_of(name, *arguments[name]) for name in call.kwargs},
        _output_dims("nn.MultiheadAttention", call, batch_size, [dims["query"], 0][: len(call.outputs)]),
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
