"""Fast-engine rules for Hugging Face transformers' layers: GPT-2's Conv1D and the RMSNorm layers of Llama and kin.

``transformers`` is optional for dpfleet, so its layer types are recognised by
their module and class name (``register_rule_by_name``): this module never
imports it, and registers the same rules whether it is installed or not.
Registered with ``workers.layer_rules``' registry when imported;
``workers.engines`` imports this module.

A type recognised by name is taken on trust no more than any other: the
engine's rule check compares every rule with autograd on each model, and a
layer whose forward computes something else sends the model to the vmap
engine. The attention functions of these models have no parameters and need
no rule.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from workers.layer_rules import (
    LayerCall,
    ParameterGradients,
    affine_gradients,
    affine_map_gradients,
    over_positions,
    register_rule_by_name,
)


def is_transformers_conv1d(layer_type: type[nn.Module]) -> bool:
    """Whether ``layer_type`` is ``transformers.pytorch_utils.Conv1D`` (GPT-2's layer), by module and class name."""
    return layer_type.__module__ == "transformers.pytorch_utils" and layer_type.__qualname__ == "Conv1D"


@register_rule_by_name(is_transformers_conv1d)
def conv1d_rule(
    layer: nn.Module, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """transformers' Conv1D, x @ weight + bias with weight [in, out]: the Linear rule, its sums laid out transposed."""
    in_features, out_features = layer.weight.shape
    return affine_map_gradients(
        params, calls, batch_size, in_features, out_features,
        lambda summed: summed.view(out_features, in_features).t(),
    )


def is_rms_norm_by_name(layer_type: type[nn.Module]) -> bool:
    """Whether ``layer_type``'s class name ends with "RMSNorm" (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm, ...)."""
    return layer_type.__name__.endswith("RMSNorm")


def has_llama_rms_norm_form(layer: nn.Module) -> bool:
    """Whether a layer holds what LlamaRMSNorm holds: one 1-D ``weight`` parameter, a float ``variance_epsilon``, no
    bias and no submodules. Layers of another form (Gemma's ``eps``, a bias) take the vmap fallback."""
    weight = getattr(layer, "weight", None)
    return (
        isinstance(weight, nn.Parameter) and weight.dim() == 1
        and [name for name, _ in layer.named_parameters()] == ["weight"]
        and isinstance(getattr(layer, "variance_epsilon", None), float)
        and getattr(layer, "bias", None) is None
        and next(layer.children(), None) is None
    )


@register_rule_by_name(is_rms_norm_by_name, supports=has_llama_rms_norm_form)
def llama_rms_norm_rule(
    layer: nn.Module, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """LlamaRMSNorm and its kin: weight * (x * rsqrt(mean(x^2) + eps)), the normalisation in float32.

    Example i's weight gradient is the sum over its positions of the output
    gradient times the normalised input, which ``llama_rms_normalized``
    computes from the recorded input as the layer does.
    """
    return affine_gradients(
        params, calls, batch_size,
        normalize=lambda x: llama_rms_normalized(x, layer.variance_epsilon),
        reduce=over_positions(batch_size, layer.weight.numel()),
    )


def llama_rms_normalized(inputs: Tensor, variance_epsilon: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dimension, computed in float32 and cast back, as LlamaRMSNorm does."""
    in_float32 = inputs.to(torch.float32)
    variance = in_float32.pow(2).mean(-1, keepdim=True)
    return (in_float32 * torch.rsqrt(variance + variance_epsilon)).to(inputs.dtype)
